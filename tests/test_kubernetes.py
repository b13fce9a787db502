"""deploy/kubernetes, checked offline: against the Kubernetes API schema of a current release
(kubernetes-validate, strict: an unknown field is an error), and against the relay itself:
every command and flag parses as `relay` parses it, every RELAY_* variable is one the
command reads and its value is one it accepts, every probe's path is one the process serves,
on the port the configuration names; the shutdown grace fits the pod's termination grace,
and the user the pods run as is the image's."""

from __future__ import annotations

import asyncio
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from relay.cli.common import OPS_OPTIONS
from relay.cli.console import console_cmd
from relay.cli.main import cli
from relay.cli.migrate import MIGRATE_OPTIONS
from relay.console.app import Console, ConsoleConfig, make_app
from relay.console.hosts import allowed_hosts
from relay.db.names import OutboxNames
from relay.embed import Relay
from relay.httpd import serve
from relay.options import resolve
from relay.wiring import START_ALL
from relay.worker import lease_margin
from tests.helpers import http_get

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES = "1.37"  # the newest release kubernetes-validate knows (test_the_schema_is_a_current_release)
RELAY_IMAGE = "outbox-relay"

# What a secret's value looks like to the relay, by key: the manifests' own placeholders
# would do too, but a test should not depend on a file someone is told to replace.
SECRET_VALUES = {
    "relay-dsn": "postgresql://relay:pw@db.internal:5432/app",
    "owner-dsn": "postgresql://owner:pw@db.internal:5432/app",
    "amqp-url": "amqp://relay:pw@rabbitmq.internal:5672/",
}


def kustomizations() -> Iterator[Path]:
    yield from sorted(K8S.rglob("kustomization.yaml"))


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every resource every kustomization lists, as (file, document)."""
    found = []
    for kustomization in kustomizations():
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            path = kustomization.parent / resource
            for doc in yaml.safe_load_all(path.read_text()):
                found.append((str(path.relative_to(K8S)), doc))
    return found


def by_kind(kind: str, name: str) -> dict[str, Any]:
    [doc] = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the process sees it, secrets by their keys' stand-ins."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = SECRET_VALUES[ref["key"]]
    return env


def relay_containers() -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(file, workload, container) for every container of the relay's image."""
    for file, doc in documents():
        if doc["kind"] in ("Deployment", "Job"):
            for container in pod_spec(doc)["containers"]:
                if container["image"] == RELAY_IMAGE:
                    yield file, doc, container


def test_every_manifest_is_in_a_kustomization() -> None:
    listed = {file for file, _ in documents()}
    on_disk = {str(p.relative_to(K8S)) for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk == listed


def test_the_schema_is_a_current_release() -> None:
    assert kubernetes_validate.utils.latest_version().startswith(KUBERNETES)


@pytest.mark.parametrize(("file", "doc"), [(f, d) for f, d in documents() if d["apiVersion"].count("/") < 2])
def test_each_manifest_is_valid_against_the_kubernetes_api_schema(file: str, doc: dict[str, Any]) -> None:
    if doc["kind"] == "PodMonitor":  # a CRD of the Prometheus Operator: checked below
        return
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_schema_check_can_fail() -> None:
    broken = copy.deepcopy(by_kind("Deployment", "outbox-relay"))
    pod_spec(broken)["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_the_relays_configuration_is_what_relay_start_accepts() -> None:
    """The Deployment's command line and variables, as `relay start` would read them: known
    names only, every value valid (a Relay is built from them, which refuses what `relay
    start` refuses), probes on the metrics port it serves, a termination grace that covers
    the shutdown grace."""
    deployment = by_kind("Deployment", "outbox-relay")
    [container] = pod_spec(deployment)["containers"]
    args = container["args"]
    assert "command" not in container  # the image's entry point: relay
    assert args[0] in cli.commands and args[0] == "start"
    params = cli.commands["start"].make_context("start", list(args[1:])).params
    env = container_env(container)
    known = {o.env for o in START_ALL} | {"RELAY_CONFIG"}
    assert set(env) <= known, sorted(set(env) - known)
    relay = Relay(environ=env, **{k: v for k, v in params.items() if v not in (None, ()) and k != "config_path"})
    settings = relay.settings

    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == relay.operations.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == relay.operations.metrics_port
    assert annotations["prometheus.io/path"] == "/metrics"
    # SIGTERM, then the shutdown grace, then the outcomes recorded and the rest handed back.
    needed = settings.shutdown_grace + lease_margin(settings.worker.lease)
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= needed.total_seconds() + 5


async def test_the_relays_probe_paths_are_served() -> None:
    """What the probes and the scrape ask for, asked of the relay's own server: /healthz
    and /readyz answer (the readiness says not ready, on purpose), /metrics too."""

    async def not_ready() -> tuple[bool, str]:
        return False, "broker: down"

    server = await serve(0, CollectorRegistry(), not_ready, host="127.0.0.1")
    port = server.sockets[0].getsockname()[1]
    try:
        deployment = by_kind("Deployment", "outbox-relay")
        [container] = pod_spec(deployment)["containers"]
        paths = [container[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe")]
        paths.append(deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
        codes = await asyncio.gather(*(asyncio.to_thread(http_get, f"http://127.0.0.1:{port}{p}") for p in paths))
    finally:
        server.close()
        await server.wait_closed()
    assert [code for code, _body in codes] == [200, 503, 200]


def test_the_migration_job_runs_relay_migrate_as_the_owner() -> None:
    job = by_kind("Job", "outbox-relay-migrate")
    [container] = pod_spec(job)["containers"]
    assert container["args"] == ["migrate"]
    cli.commands["migrate"].make_context("migrate", [])
    env = container_env(container)
    assert set(env) <= {o.env for o in MIGRATE_OPTIONS}
    resolve(MIGRATE_OPTIONS, {}, {}, env)  # raises on a value migrate refuses
    [ref] = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == "RELAY_DSN"]
    assert ref["key"] == "owner-dsn"
    assert pod_spec(job)["restartPolicy"] == "Never"


async def test_the_console_is_optional_and_its_probes_are_answered() -> None:
    deployment = by_kind("Deployment", "outbox-relay-console")
    [container] = pod_spec(deployment)["containers"]
    args = container["args"]
    assert args[0] == "console"
    params = console_cmd.make_context("console", list(args[1:])).params
    env = container_env(container)
    assert set(env) <= {o.env for o in OPS_OPTIONS}
    resolve(OPS_OPTIONS, {}, {}, env)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == params["port"]
    service = by_kind("Service", "outbox-relay-console")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert service["metadata"]["name"] in params["allow_hosts"]
    # The probe as the kubelet sends it (Host header included), to the console's own app
    # configured from the manifest's --host and --allow-host (/healthz reads no database).
    probe = container["livenessProbe"]["httpGet"]
    assert container["readinessProbe"]["httpGet"] == probe
    headers = {h["name"]: h["value"] for h in probe.get("httpHeaders", [])}
    config = ConsoleConfig(
        names=OutboxNames(),
        where="db",
        allow_actions=False,
        by=None,
        allowed_hosts=allowed_hosts(params["host"], tuple(params["allow_hosts"])),
    )
    app = make_app(Console(config, pool=None, history=None, guard=None))  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        answer = await client.get(probe["path"], headers=headers)
        refused = await client.get(probe["path"], headers={"Host": "10.1.2.3:8465"})
    assert answer.status == 200
    assert refused.status != 200  # without the header the kubelet's request would be refused


def test_secrets_referenced_exist_and_pods_run_as_the_images_user() -> None:
    secret = by_kind("Secret", "outbox-relay")
    image_user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "Containerfile").read_text(), re.M)
    assert image_user is not None
    uid = int(image_user.group(1))
    for file, workload, container in relay_containers():
        for item in container.get("env", []):
            if "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                assert ref["name"] == secret["metadata"]["name"], file
                assert ref["key"] in secret["stringData"], (file, ref)
        pod = pod_spec(workload)["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid, file
        own = container["securityContext"]
        assert own["readOnlyRootFilesystem"] is True and own["allowPrivilegeEscalation"] is False, file
        assert "resources" in container and container["resources"]["limits"]["memory"], file


def test_the_pod_monitor_and_the_disruption_budget_select_the_relays() -> None:
    deployment = by_kind("Deployment", "outbox-relay")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    [container] = pod_spec(deployment)["containers"]
    monitor = by_kind("PodMonitor", "outbox-relay")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    assert endpoint["path"] == "/metrics"
    pdb = by_kind("PodDisruptionBudget", "outbox-relay")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
