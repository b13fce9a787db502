"""Destinations outside the relay's package, found through the entry-point group
``outbox_relay.destinations``: tests/plugins/redis_streams (installed by `make venv`)
delivers with a real `relay start`, `relay --help` lists it without importing an SDK, and
a broken, duplicate or shadowing entry point is one line, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from relay.adapters.registry import DISABLE_INSTALLED
from tests.conftest import Db
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def with_installed(**extra: str) -> dict[str, str]:
    """A relay's environment that looks for installed destinations (the suite's does not)."""
    env = relay_env(**extra)
    env.pop(DISABLE_INSTALLED, None)
    return env


@pytest.fixture
def redis_stream() -> Iterator[tuple[redis.Redis, str]]:
    """A stream of the test's own, made with a consumer group as a deployment makes one."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except (redis.ConnectionError, OSError):
        if os.environ.get("RELAY_TEST_REQUIRE_SERVICES") == "1":
            pytest.fail(f"no Redis at {REDIS_URL}")
        pytest.skip(f"no Redis at {REDIS_URL} (set RELAY_TEST_REDIS_URL)")
    stream = f"relay-test-{uuid.uuid4().hex[:12]}"
    client.xgroup_create(stream, "readers", id="$", mkstream=True)
    yield client, stream
    client.delete(stream)
    client.close()


def test_relay_start_delivers_to_a_destination_found_through_its_entry_point(
    db: Db, relay_dsn: str, redis_stream: tuple[redis.Redis, str], relays: list[RelayProcess]
) -> None:
    client, stream = redis_stream
    ids = db.insert((f"order-{i % 3}", "OrderPlaced", {"i": i}) for i in range(9))
    relay = RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "redis-streams", "--redis-url", REDIS_URL,
        "--stream", stream, "--workers", "2", "--poll-interval", "100ms",
        env=with_installed(RELAY_DSN=relay_dsn),
    )  # fmt: skip
    relays.append(relay)
    assert wait_until(lambda: db.settled(9), timeout=30), relay.tail()
    entries = client.xrange(stream)
    rows = {r["id"]: r for r in db.rows()}
    assert sorted(int(fields[b"outbox_id"]) for _, fields in entries) == ids
    for _, fields in entries:
        row = rows[int(fields[b"outbox_id"])]
        assert fields[b"event_id"].decode() == str(row["event_id"])
        assert fields[b"event_type"] == b"OrderPlaced" and json.loads(fields[b"payload"]) == row["payload"]
    relay.stop()
    relay.assert_clean_exit()


def test_a_missing_stream_holds_its_messages_until_it_is_made(
    db: Db, relay_dsn: str, relays: list[RelayProcess]
) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    stream = f"relay-test-later-{uuid.uuid4().hex[:12]}"
    db.insert([("order-1", "OrderPlaced", {"i": 1})])
    relay = RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "redis-streams", "--redis-url", REDIS_URL,
        "--stream", stream, "--poll-interval", "100ms", "--backoff-base", "100ms", "--backoff-cap", "300ms",
        env=with_installed(RELAY_DSN=relay_dsn),
    )  # fmt: skip
    relays.append(relay)
    try:
        # Looked at before the relay is ready (its destination check), and held, unspent.
        assert wait_until(lambda: "missing" in relay.stderr(), timeout=20), relay.tail()
        assert db.rows()[0]["status"] != "dead" and client.exists(stream) == 0
        client.xgroup_create(stream, "readers", id="$", mkstream=True)
        assert wait_until(lambda: db.settled(1), timeout=30), relay.tail()
        assert db.rows()[0]["status"] == "done" and client.xlen(stream) == 1
    finally:
        client.delete(stream)
        client.close()
    relay.stop()
    relay.assert_clean_exit()


def test_without_discovery_the_installed_destination_is_no_choice() -> None:
    proc = run_relay("start", "--dsn", "postgresql://nobody@127.0.0.1:1/x", "--broker", "redis-streams")
    assert_one_line_error(proc, "invalid --broker: 'redis-streams'", "choose from sqs, sns, rabbitmq")


def _loaded_by_help(env: dict[str, str]) -> tuple[str, list[str]]:
    """`relay start --help`'s text, and the modules of SDKs and destinations it imported."""
    code = (
        "import sys; sys.argv = ['relay', 'start', '--help']\n"
        "from relay.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "roots = ('aio_pika', 'boto3', 'botocore', 'aiokafka', 'nats', 'aiohttp', 'redis', 'relay_redis_streams',"
        " 'relay.testing', 'pytest')\n"
        "print('LOADED', ','.join(sorted(m for m in sys.modules if m.startswith(roots))), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60, check=True)
    _, _, loaded = proc.stderr.strip().splitlines()[-1].partition(" ")
    return proc.stdout, [m for m in loaded.split(",") if m]


def test_help_lists_an_installed_destination_and_imports_no_sdk() -> None:
    text, loaded = _loaded_by_help(with_installed())
    assert "[sqs|sns|rabbitmq|http|kafka|nats|log|redis-streams]" in text
    assert "--redis-url" in text and "RELAY_REDIS_URL" in text
    # Its spec's module is read for its options; its publisher (and redis-py) only when used.
    assert loaded == ["relay_redis_streams", "relay_redis_streams.settings"], loaded
    text, loaded = _loaded_by_help(relay_env())
    assert "redis-streams" not in text and loaded == [], loaded


def _dist(root: Path, name: str, version: str, entry_points: str) -> None:
    """An installed distribution as importlib.metadata finds one: its metadata and entry points."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[outbox_relay.destinations]\n{entry_points}\n")


@pytest.fixture
def odd_installs(tmp_path: Path) -> dict[str, str]:
    """An environment where packages declare a destination that cannot be imported, one
    that two packages declare, one that names a built-in, and one whose spec has another name."""
    _dist(tmp_path, "broken-dest", "1.0", "broken = no_such_module:SPEC")
    _dist(tmp_path, "twin-a", "1.0", "twin = relay_redis_streams:SPEC")
    _dist(tmp_path, "twin-b", "2.0", "twin = relay_redis_streams:SPEC")
    _dist(tmp_path, "shadow", "1.0", "rabbitmq = relay_redis_streams:SPEC")
    _dist(tmp_path, "misnamed", "1.0", "other = relay_redis_streams:SPEC")
    return with_installed(PYTHONPATH=str(tmp_path))


def test_a_broken_duplicate_or_shadowing_entry_point_is_one_warning_line_each(odd_installs: dict[str, str]) -> None:
    proc = run_relay("start", "--help", env=odd_installs)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 4, proc.stderr
    assert any(
        "destination broken of broken-dest 1.0 (broken = no_such_module:SPEC) cannot be loaded:"
        " ModuleNotFoundError: No module named 'no_such_module'" in line
        for line in lines
    ), lines
    assert any("destination twin is declared by twin-a 1.0" in line and "neither is used" in line for line in lines)
    assert any("destination rabbitmq of shadow 1.0" in line and "built in" in line for line in lines), lines
    assert any("destination other of misnamed 1.0" in line and "names itself 'redis-streams'" in line for line in lines)
    # Names are read without importing anything: broken and other are choices still (choosing
    # one says why it cannot be used); neither twin nor the shadowing rabbitmq is.
    assert "[sqs|sns|rabbitmq|http|kafka|nats|log|broken|other|redis-streams]" in proc.stdout


def test_choosing_a_destination_that_cannot_be_loaded_is_one_error_line(odd_installs: dict[str, str]) -> None:
    proc = run_relay("start", "--dsn", "postgresql://nobody@127.0.0.1:1/x", "--broker", "broken", env=odd_installs)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("relay: destination broken of broken-dest 1.0") and "No module named" in last, last
    twin = run_relay("start", "--dsn", "postgresql://nobody@127.0.0.1:1/x", "--broker", "twin", env=odd_installs)
    assert twin.returncode == 2 and "invalid --broker: 'twin'" in twin.stderr.strip().splitlines()[-1], twin.stderr
