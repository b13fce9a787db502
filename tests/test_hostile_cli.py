"""The issue's hostile and careless inputs against the real `relay` command: malformed URLs
and DSNs never print their password, producer data never reaches a terminal raw, and one
huge field neither freezes a running relay nor an operator command."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.ops_helpers import claim_until, kill, run_parallel, target
from tests.rabbitmq_broker import Rabbit, relay_args
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay

MakeStore = Callable[..., Awaitable[OutboxStore]]

SECRETS = ("Secret55", "S3cr3t", "PW_xyz")
NO_DATABASE = "postgresql://postgres@127.0.0.1:1/x"
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")  # all but \n


def assert_no_secret(proc: subprocess.CompletedProcess[str]) -> None:
    for secret in SECRETS:
        assert secret not in proc.stdout + proc.stderr, (secret, proc.stderr)


BAD_AMQP_URLS = [
    "amqp//guest:Secret55@127.0.0.1:5672/",  # the colon forgotten
    "amqp:/guest:Secret55@127.0.0.1:5672/",  # a slash forgotten
    "amqp://guest:Secret55/x@127.0.0.1:5672/",  # an unencoded "/" in the password
    "amqp://guest:Secret55#x@127.0.0.1:5672/",  # an unencoded "#"
    "amqp://guest:Secret55@127.0.0.1:56x2/",  # a port that is not a number
    "guest:Secret55@127.0.0.1:5672",  # no scheme at all
]


def test_a_malformed_amqp_url_is_one_line_without_its_password() -> None:
    runs = [["start", "--dsn", NO_DATABASE, "--broker", "rabbitmq", "--amqp-url", url] for url in BAD_AMQP_URLS]
    for args, proc in zip(runs, run_parallel(*runs), strict=True):
        assert_one_line_error(proc, "invalid --amqp-url: ")
        assert_no_secret(proc)
        assert proc.stdout == "", args


def test_a_malformed_amqp_url_from_the_environment_is_one_line_without_its_password() -> None:
    for url in BAD_AMQP_URLS[:4]:
        proc = run_relay("start", "--dsn", NO_DATABASE, "--broker", "rabbitmq", env=relay_env(RELAY_AMQP_URL=url))
        assert_one_line_error(proc, "invalid --amqp-url: ")
        assert_no_secret(proc)


BAD_DSNS = [
    "postgresql://postgres:S3cr3t/PW_xyz@127.0.0.1/db",  # the issue's: "host postgres:S3cr3t database 'PW_xyz@..."
    "postgresql://postgres:x@S3cr3t@127.0.0.1/db",
    "postgresql://postgres:S3cr3t@127.0.0.1:54x2/db",
    "host=127.0.0.1 port=S3cr3t dbname=db",
]


def test_a_malformed_dsn_is_one_line_without_its_password_in_every_command() -> None:
    commands = (
        ["status"], ["status", "--by-event-type"], ["dead", "list"], ["explain", "a"], ["migrate"],
        ["start", "--broker", "log"],
    )  # fmt: skip
    # Every command with two of the DSNs and every DSN with two to four commands (each
    # run is a process start; all 24 pairs took 14 s, and every command reads --dsn alike).
    runs = [[*c, "--dsn", BAD_DSNS[(i + k) % len(BAD_DSNS)]] for i, c in enumerate(commands) for k in (0, 1)]
    for args, proc in zip(runs, run_parallel(*runs), strict=True):
        assert_one_line_error(proc, "invalid --dsn: ")
        assert_no_secret(proc)
        assert proc.stdout == "", args


def test_a_malformed_dsn_from_relay_dsn_is_one_line_without_its_password() -> None:
    for dsn in BAD_DSNS:
        for args in (["status"], ["start", "--broker", "log"]):
            proc = run_relay(*args, env=relay_env(RELAY_DSN=dsn))
            assert_one_line_error(proc, "invalid --dsn: ")
            assert_no_secret(proc)


def test_a_url_that_parses_but_cannot_connect_names_its_parts_without_the_password(
    pg_dsn: str, relay_dsn: str, names: OutboxNames
) -> None:
    # The second has an unencoded "@": both urlsplit and aio-pika's yarl end the user info
    # at the last one, so it is taken as meant (password "x@Secret55").
    urls = ("amqp://guest:Secret55@127.0.0.1:1/", "amqp://guest:x@Secret55@127.0.0.1:1/")
    for proc in run_parallel(*(["start", *relay_args(relay_dsn, names, url)] for url in urls)):
        assert_one_line_error(proc, "cannot connect to RabbitMQ at amqp://guest@127.0.0.1:1/")
        assert_no_secret(proc)


# --- producer data in the operator commands' text output ------------------------------------

ESCAPED_ID = "agg\x1b[2J\x1b[H\r\nrelay: all clear\u202e"


@pytest.fixture
async def hostile_outbox(make_store: MakeStore, db: Db) -> Db:
    """Dead rows whose event types, aggregate ids and errors carry escape sequences and
    newlines, and one error written unmasked (by a relay from before last_error was masked)."""
    store = await make_store(OrderingMap(default_ordered=True))
    ids = db.insert([(ESCAPED_ID, "Order\nPaid", {}), ("b\x1b]0;owned\x07", "Order\x1b[31mShipped", {})])
    db.insert([("c", "Order\rPlaced", {}), ("c", "OrderPlaced", {})])
    messages = await claim_until(store, set(ids))
    await kill(store, [messages[i] for i in ids], "PermanentError: rejected")
    db.conn.execute(
        sql.SQL("UPDATE {} SET last_error = %s WHERE id = %s").format(db.table),
        ("PermanentError: \x1b[31mno\x1b[0m queue at amqp://relay:Secret55/x@mq:5672/\nsecond line", ids[0]),
    )
    return db


def test_operator_commands_print_producer_data_escaped_one_row_per_row(hostile_outbox: Db, relay_dsn: str) -> None:
    flags = target(relay_dsn, hostile_outbox)
    dead, groups, status, explain = run_parallel(
        ["dead", "list", *flags],
        ["dead", "list", "--group", *flags],
        ["status", "--by-event-type", *flags],
        ["explain", ESCAPED_ID, *flags],
    )
    for proc in (dead, groups, status, explain):
        assert proc.returncode == 0, proc.stderr
        assert not RAW_CONTROL.search(proc.stdout), proc.stdout
        assert_no_secret(proc)
    assert len(dead.stdout.strip().splitlines()) == 1 + 2 + 1  # header, two dead rows, the BLOCKS hint
    assert "\\x1b[2J\\x1b[H\\r\\nrelay: all clear\\u202e" in dead.stdout
    assert "relay:***@mq" in dead.stdout
    table = status.stdout.split("EVENT TYPE", 1)[1].strip().splitlines()
    assert len(table) == 1 + 4, status.stdout  # the header's tail, then one row per event type
    assert any(row.strip().startswith("Order\\nPaid") for row in table)
    assert any(row.strip().startswith("Order\\rPlaced") for row in table)
    assert "'agg\\x1b[2J\\x1b[H\\r\\nrelay: all clear\\u202e'" in explain.stdout
    assert "relay:***@mq" in explain.stdout


def test_dead_list_json_keeps_producer_data_exact_and_the_error_masked(hostile_outbox: Db, relay_dsn: str) -> None:
    proc = run_relay("dead", "list", "--json", *target(relay_dsn, hostile_outbox))
    assert proc.returncode == 0, proc.stderr
    assert "\\u001b[2J" in proc.stdout  # JSON's own escape of the producer's ESC
    assert_no_secret(proc)


# --- one huge field ---------------------------------------------------------------------------


def test_explain_of_a_huge_aggregate_id_and_a_huge_table_name_answer_at_once(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, tmp_path: Path
) -> None:
    """On main, masking these error lines took 21 s and 10 minutes."""
    config = tmp_path / "relay.toml"
    config.write_text(f'table = "{"t" * 1_000_000}"\n')
    started = time.monotonic()
    explain, table = run_parallel(
        ["explain", "x" * 60_000, "--dsn", relay_dsn, "--schema", names.schema],
        ["status", "--dsn", relay_dsn, "--config", str(config)],
    )
    assert time.monotonic() - started < 10
    assert_one_line_error(explain, "not found")
    assert_one_line_error(table, "invalid table name")
    assert len(explain.stderr) < 1000 and len(table.stderr) < 1000


async def _until(db: Db, process: RelayProcess, statuses: dict[str, int], timeout: float) -> float:
    """Seconds until the outbox holds exactly ``statuses``."""
    started = time.monotonic()
    while (now := await asyncio.to_thread(db.statuses)) != statuses:
        assert process.running(), process.stderr()
        assert time.monotonic() - started < timeout, (now, process.stderr()[-3000:])
        await asyncio.sleep(0.05)
    return time.monotonic() - started


FORGED_ID = "x\x1b[2K\r\n2026-01-01T00:00:00.000Z INFO    relay.worker: FORGED all messages delivered"
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


async def test_a_huge_event_type_and_a_forged_aggregate_id_neither_delay_nor_forge_anything(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path
) -> None:
    """The issue's running case: one row with a 70,000-character event type among 300 normal
    rows went dead correctly, but logging it froze the relay for 29 s. Here the 300 arrive
    within a second of a control run without it, and every log record is one line."""
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "Order.#"))
    # Batches of 20, so that the 300 take 15 batches, all after the long row's (it is
    # written first): whatever logging it costs, every batch behind it waits for.
    args = relay_args(relay_dsn, names, rabbit.amqp.url, "--exchange", exchange, "--workers", "2", "--batch-size", "20")
    # The forged row goes dead (and its aggregate id into a dead row's log line) as unroutable.
    process = RelayProcess("start", *args, "--unroutable", "permanent")
    relays.append(process)
    await process.wait_for_log("relay started")

    def normal(run: str) -> list[tuple[str, str, dict[str, int]]]:
        return [(f"{run}-{i}", "Order.Placed", {"i": i}) for i in range(300)]

    await asyncio.to_thread(db.insert, normal("control"))
    control = await _until(db, process, {"done": 300}, timeout=60)

    started = time.monotonic()
    ids = await asyncio.to_thread(db.insert, [("long", "E" * 70_000, {}), (FORGED_ID, "Unrouted", {})])
    await asyncio.to_thread(db.insert, normal("hostile"))
    hostile = time.monotonic() - started + await _until(db, process, {"done": 600, "dead": 2}, timeout=60)
    assert hostile < control + 1.0, (control, hostile)
    assert len(await rabbit.drain(queue, 600, timeout=30)) == 600

    # The dead rows' log lines: short, saying how long the event type was, one line each.
    log = process.stderr()
    lines = log.splitlines()
    assert all(STAMP.match(line) for line in lines), [line[:200] for line in lines if not STAMP.match(line)]
    assert not any(line.startswith("2026-01-01T00:00:00.000Z") for line in lines)
    assert "\x1b" not in log and "\r" not in log
    long_lines = [line for line in lines if "E" * 100 in line]
    assert long_lines and all(len(line) < 5000 and "…(70000 chars)" in line for line in long_lines), long_lines
    assert [line for line in lines if "FORGED" in line] == [
        line for line in lines if "x\\x1b[2K\\r\\n2026-01-01T00:00:00.000Z" in line
    ]

    # An operator re-drives the long row (26 s on main, logging it): at once.
    started = time.monotonic()
    retry = run_relay("dead", "retry", str(ids[0]), "--dsn", relay_dsn, "--schema", names.schema)
    assert retry.returncode == 0, retry.stderr
    assert time.monotonic() - started < 5
    assert all(len(line) < 5000 for line in retry.stdout.splitlines() + retry.stderr.splitlines())
    assert process.stop() == 0, process.stderr()[-3000:]
