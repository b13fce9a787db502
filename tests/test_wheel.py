"""The wheel as users install it: one top-level package, `relay` (the adapters inside it),
typed, and per-broker extras: with only `outbox-relay[rabbitmq]` installed, `relay start
--broker rabbitmq` runs, and `--broker sqs` says which extra to install, in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
import venv
import zipfile
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built by pip with the build backend of the test environment (hatchling,
    a dev dependency): an isolated build would fetch the backend from the package index,
    and the first test here is a unit test, which runs with no network."""
    out = tmp_path_factory.mktemp("wheel")
    build = ("wheel", "--no-deps", "--no-build-isolation", "--quiet", "--wheel-dir", str(out), str(ROOT))
    subprocess.run(
        [sys.executable, "-m", "pip", *build],
        check=True,
        capture_output=True,
        text=True,
    )
    [built] = out.glob("outbox_relay-*.whl")
    return built


def test_the_wheel_holds_one_top_level_package_typed(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"relay"}, sorted(top)
    assert "relay/py.typed" in names
    assert "relay/adapters/rabbitmq/publisher.py" in names
    assert "relay/_sql/queries.sql" in names and "relay/_sql/inbox.sql" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    assert not any("boto3" in r or "aio-pika" in r for r in base), base
    for extra in ("rabbitmq", "sqs", "sns", "all"):
        assert f"Provides-Extra: {extra}" in metadata


@pytest.mark.extended
def test_a_venv_with_only_the_rabbitmq_extra(wheel: Path, tmp_path: Path, pg_dsn: str) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"outbox-relay[rabbitmq] @ {wheel.as_uri()}"],
        check=True,
        capture_output=True,
        text=True,
    )
    relay = env_dir / "bin" / "relay"
    have = subprocess.run([str(python), "-c", "import aio_pika, importlib.util as u; print(u.find_spec('boto3'))"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert have.stdout.strip() == "None"
    sqs = subprocess.run(
        [str(relay), "start", "--dsn", pg_dsn, "--broker", "sqs", "--queue-url", "https://sqs.eu-west-1.amazonaws.com/1/q"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert sqs.returncode == 2, sqs.stderr
    lines = sqs.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'outbox-relay[sqs]'" in lines[0], sqs.stderr
    http = subprocess.run(
        [str(relay), "start", "--dsn", pg_dsn, "--broker", "http", "--url", "https://api.example.com/hooks"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = http.stderr.strip().splitlines()
    assert http.returncode == 2 and len(lines) == 1 and "pip install 'outbox-relay[http]'" in lines[0], http.stderr
    kafka = subprocess.run(
        [str(relay), "start", "--dsn", pg_dsn, "--broker", "kafka", "--bootstrap-servers", "k:9092", "--topic", "t"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = kafka.stderr.strip().splitlines()
    assert kafka.returncode == 2 and len(lines) == 1 and "pip install 'outbox-relay[kafka]'" in lines[0], kafka.stderr
    # And the broker it was installed for runs: migrate an outbox, start, stop on SIGTERM.
    schema = f"w_{uuid.uuid4().hex[:10]}"
    common = ("--dsn", pg_dsn, "--schema", schema)
    migrated = subprocess.run([str(relay), "migrate", *common], capture_output=True, text=True, timeout=60)
    assert migrated.returncode == 0, migrated.stderr
    amqp = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
    started = subprocess.Popen(
        [str(relay), "start", *common, "--broker", "rabbitmq", "--amqp-url", amqp, "--exchange", "amq.topic"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert started.stderr is not None
        lines = []
        for line in started.stderr:
            lines.append(line)
            if "relay started" in line:
                break
        assert any("relay started" in line for line in lines), "".join(lines)
        started.send_signal(signal.SIGTERM)
        assert started.wait(timeout=30) == 0
    finally:
        started.kill()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
