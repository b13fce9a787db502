"""The container image, built from ./Containerfile and exercised here (`make image-test`).

scripts/image.sh builds it with Debian's buildah on a debootstrap base; the tests run
commands inside it with ``buildah run --isolation chroot --network host``, against this
machine's PostgreSQL and RabbitMQ: `relay migrate`, then `relay start --broker rabbitmq
--metrics-port` delivering a batch of events, its probes, and SIGTERM. What it measured
(build time, image size, the delivery) is printed, for the notes and docs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.helpers import http_get
from tests.metric_names import free_port
from tests.rabbitmq_broker import Rabbit

pytestmark = pytest.mark.image

ROOT = Path(__file__).resolve().parent.parent
TAG = "localhost/outbox-relay:test"
UID = 10001
EVENTS = 500
MORE = 20_000  # written while it runs; SIGTERM comes while they are being delivered
GRACE_S = 5
ENV = {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "vfs")}


def buildah(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["buildah", *args], env=ENV, capture_output=True, text=True, check=check, timeout=600)


@pytest.fixture(scope="module")
def image() -> str:
    for tool in ("buildah", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (apt-get install {tool}; .ci/run does)")
    started = time.monotonic()
    subprocess.run(["bash", "scripts/image.sh", TAG], cwd=ROOT, env=ENV, check=True, timeout=1200)
    took = time.monotonic() - started
    size = buildah("images", "--format", "{{.Size}}", TAG).stdout.strip()
    print(f"\nimage {TAG}: {size}, built in {took:.1f} s (the debootstrap base included when it was absent)")
    return TAG


@pytest.fixture
def container(image: str) -> Iterator[str]:
    name = f"relay-test-{uuid.uuid4().hex[:8]}"
    buildah("from", "--name", name, image)
    try:
        yield name
    finally:
        buildah("rm", name, check=False)


def run_in(container: str, *command: str, env: dict[str, str] | None = None) -> list[str]:
    """``buildah run`` of ``command`` in ``container``, as its configured user, on the host's network."""
    options = [f"--env={k}={v}" for k, v in (env or {}).items()]
    return ["buildah", "run", "--isolation", "chroot", "--network", "host", *options, container, "--", *command]


def test_the_image_runs_relay_as_a_non_root_user_with_no_build_tools(image: str, container: str) -> None:
    config = json.loads(buildah("inspect", "--type", "image", image).stdout)["OCIv1"]["config"]
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["relay"] and config["Cmd"] == ["start"]
    whoami = subprocess.run(run_in(container, "id", "-u"), env=ENV, capture_output=True, text=True, check=True)
    assert whoami.stdout.strip() == str(UID)
    tools = subprocess.run(
        run_in(container, "sh", "-c", "for t in gcc cc make pip pip3; do command -v $t; done; true"),
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    )
    assert tools.stdout.strip() == "", f"build tools left in the image: {tools.stdout.split()}"
    # Every broker's client, the console and tracing are in; nothing can be written where the relay lives.
    probe = (
        "import aio_pika, boto3, aiohttp, aiokafka, nats, jinja2, opentelemetry.sdk, relay.console.app, relay;"
        " print(relay.__file__)"
    )
    found = subprocess.run(run_in(container, "python3", "-c", probe), env=ENV, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr
    assert found.stdout.startswith("/opt/relay/")
    write = subprocess.run(run_in(container, "touch", "/opt/relay/x"), env=ENV, capture_output=True, text=True)
    assert write.returncode != 0


def _relay_pid(port: int) -> int | None:
    """The relay process inside the container (not buildah, whose arguments name it too)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if comm == "relay" and b"start" in cmdline and str(port).encode() in cmdline:
            return int(entry.name)
    return None


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


class InImage:
    """`relay migrate`, then `relay start` in the container, against ``schema``."""

    def __init__(self, container: str, pg_dsn: str, schema: str, env: dict[str, str]) -> None:
        self.container, self.pg_dsn, self.schema, self.env = container, pg_dsn, schema, env
        self.port = free_port()
        self.relay: subprocess.Popen[str] | None = None

    def _write(self, conn: psycopg.Connection[Any], rows: int) -> None:
        """``rows`` OrderPaid events over 50 aggregates."""
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'order', 'order-' || (g %% 50), 'OrderPaid', jsonb_build_object('n', g)"
                " FROM generate_series(1, %s) AS g"
            ).format(sql.Identifier(self.schema, "outbox")),
            (rows,),
        )

    def _done(self, conn: psycopg.Connection[Any]) -> int:
        query = sql.SQL("SELECT count(*) FROM {} WHERE status = 'done'").format(sql.Identifier(self.schema, "outbox"))
        [(done,)] = conn.execute(query).fetchall()
        return int(done)

    def migrate_and_write(self) -> None:
        migrate = subprocess.run(
            run_in(self.container, "relay", "migrate", env=self.env),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert migrate.returncode == 0, migrate.stderr
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            self._write(conn, EVENTS)

    def start_until_delivered(self, exchange: str) -> float:
        """Seconds from `relay start` to every row done; the probes answer 200 then."""
        started = time.monotonic()
        command = [
            "relay", "start", "--broker", "rabbitmq", "--exchange", exchange, "--routing-key", "{event_type}",
            "--metrics-port", str(self.port), "--metrics-host", "127.0.0.1",
            "--shutdown-grace", f"{GRACE_S}s", "--log-format", "json",
        ]  # fmt: skip
        self.relay = subprocess.Popen(
            run_in(self.container, *command, env=self.env),
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            while True:
                done = self._done(conn)
                if done == EVENTS:
                    break
                assert self.relay.poll() is None, self.relay.communicate()
                assert time.monotonic() < deadline, f"{done} of {EVENTS} delivered in 60 s"
                time.sleep(0.05)
        delivered_s = time.monotonic() - started
        assert http_get(f"http://127.0.0.1:{self.port}/healthz", timeout=2)[0] == 200
        ready = http_get(f"http://127.0.0.1:{self.port}/readyz", timeout=2)
        assert ready[0] == 200, ready
        return delivered_s

    def write_more_and_wait_for_some(self, rows: int) -> int:
        """``rows`` more events; returns once the relay is delivering them (some done, not all)."""
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            self._write(conn, rows)
            deadline = time.monotonic() + 30
            while True:
                done = self._done(conn)
                if done > EVENTS:
                    return int(done)
                assert time.monotonic() < deadline, "the second batch of events did not start moving"
                time.sleep(0.01)

    def statuses(self) -> dict[tuple[str, int], int]:
        """(status, attempts) -> rows."""
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            found = conn.execute(
                sql.SQL("SELECT status, attempts, count(*) FROM {} GROUP BY 1, 2").format(
                    sql.Identifier(self.schema, "outbox")
                )
            ).fetchall()
        return {(status, attempts): n for status, attempts, n in found}

    def pid(self) -> int:
        pid = _relay_pid(self.port)
        assert pid is not None, "the relay process was not found"
        return pid

    def sigterm(self) -> tuple[int, float, str]:
        """SIGTERM to the relay process; its exit code, seconds to exit, and its log's end."""
        assert self.relay is not None
        sent = time.monotonic()
        os.kill(self.pid(), signal.SIGTERM)
        _out, err = self.relay.communicate(timeout=GRACE_S + 10)
        return self.relay.returncode, time.monotonic() - sent, err[-2000:]

    def close(self) -> None:
        if self.relay is not None and self.relay.poll() is None:
            self.relay.kill()
            self.relay.wait()
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))


async def test_in_the_image_migrate_start_probes_deliver_and_sigterm_drains(
    container: str, pg_dsn: str, rabbit: Rabbit
) -> None:
    exchange = await rabbit.exchange()
    queue = await rabbit.queue()
    await rabbit.bind(queue, exchange, "OrderPaid")
    schema = f"img_{uuid.uuid4().hex[:10]}"
    env = {"RELAY_DSN": pg_dsn, "RELAY_SCHEMA": schema, "RELAY_AMQP_URL": rabbit.amqp.url}
    run = InImage(container, pg_dsn, schema, env)
    try:
        await asyncio.to_thread(run.migrate_and_write)
        delivered_s = await asyncio.to_thread(run.start_until_delivered, exchange)
        assert _uid(run.pid()) == UID
        received = await rabbit.drain(queue, expected=EVENTS, timeout=20)
        assert len(received) == EVENTS
        # SIGTERM while it delivers a second, larger batch: it drains within the grace.
        done_at_term = await asyncio.to_thread(run.write_more_and_wait_for_some, MORE)
        code, stopped_s, log = await asyncio.to_thread(run.sigterm)
        after = await asyncio.to_thread(run.statuses)
    finally:
        await asyncio.to_thread(run.close)
    assert code == 0, log
    assert stopped_s < GRACE_S + 2
    # What it had confirmed is done (one attempt each); the rest went back unspent.
    assert {status for status, _ in after} <= {"done", "pending"}, after
    assert all(attempts == 1 for status, attempts in after if status == "done"), after
    assert all(attempts == 0 for status, attempts in after if status == "pending"), after
    assert sum(after.values()) == EVENTS + MORE
    pending = sum(n for (status, _), n in after.items() if status == "pending")
    print(
        f"\nin the image: {EVENTS} events delivered {delivered_s:.2f} s after `relay start` began"
        f" (start-up included); SIGTERM with {done_at_term - EVENTS} of {MORE} more delivered:"
        f" exit 0 after {stopped_s:.2f} s, {pending} handed back pending with no attempt spent"
    )
