"""`relay status` and `relay explain` against a real PostgreSQL, and the 0003 migration."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.cli.ops import CLEAR_SCREEN
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.readmodel import WakeupStatus
from relay.db.statements import migrations, statement
from relay.errors import ConfigError
from relay.message import Decision
from relay.ops.explain import explain
from relay.ops.status import attempt_histogram, read_status
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.helpers import record_listeners
from tests.ops_helpers import Scene, build_scene, claim_until, ingest, relay_json, target
from tests.relay_process import RELAY, assert_one_line_error, popen_with_ctrl_c, relay_env, run_relay

MakeStore = Callable[..., Awaitable[OutboxStore]]
EMAIL_UNORDERED = OrderingMap(default_ordered=True, unordered=("Email*",))


@pytest.fixture
async def scene_store(make_store: MakeStore) -> OutboxStore:
    return await make_store(EMAIL_UNORDERED)


@pytest.fixture
async def scene(scene_store: OutboxStore, db: Db) -> Scene:
    return await build_scene(scene_store, db)


async def test_migration_0003_adds_the_dead_index_and_the_resolution_columns(pg_dsn: str, names: OutboxNames) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = 'outbox_dead_idx'", (names.schema,)
        )
        [(indexdef,)] = await cur.fetchall()
        assert "(id) WHERE (status = 'dead'::text)" in indexdef
        cur = await conn.execute(
            "SELECT column_name, data_type, is_nullable, column_default FROM information_schema.columns"
            " WHERE table_schema = %s AND table_name = 'outbox' AND column_name LIKE 'resol%%' ORDER BY 1",
            (names.schema,),
        )
        assert await cur.fetchall() == [
            ("resolution", "text", "YES", None),
            ("resolved_at", "timestamp with time zone", "YES", None),
            ("resolved_by", "text", "YES", None),
            ("resolved_note", "text", "YES", None),
        ]
        # Idempotent SQL: an operator may have built the index concurrently beforehand.
        [(_, _, text)] = [m for m in migrations() if m[0] == 3]
        await conn.execute(names.render(text))


async def test_status_counts_ages_attempts_and_blocked_aggregates(
    scene_store: OutboxStore, scene: Scene, db: Db, relay_dsn: str
) -> None:
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        status = await read_status(conn, db.names, by_event_type=True)
    s = status.summary
    assert (s.pending_ordered, s.pending_unordered, s.processing, s.expired_leases, s.dead) == (4, 2, 2, 1, 1)
    assert (s.blocked_aggregates, s.waiting_behind_blocked) == (1, 2)
    assert s.oldest_waiting_age_s is not None and s.oldest_blocked_age_s is not None
    assert s.oldest_waiting_age_s <= s.oldest_blocked_age_s + 1  # a1 (dead) is older than a2 (waiting)
    assert dict(status.attempts) == {0: 6, 1: 2}
    assert dict(attempt_histogram(status.attempts))["0"] == 6
    by_type = {e.event_type: e for e in status.by_event_type or ()}
    assert set(by_type) == {"OrderPlaced", "OrderPaid", "EmailQueued"}
    paid, placed = by_type["OrderPaid"], by_type["OrderPlaced"]
    assert (paid.pending, paid.processing, paid.expired_leases, paid.dead) == (1, 1, 1, 0)  # b2; c1 expired
    assert (placed.pending, placed.processing, placed.expired_leases, placed.dead) == (3, 1, 0, 1)  # a2 a3 e1; b1; a1
    assert by_type["EmailQueued"].pending == 2


async def test_status_cli_text_json_and_event_types(scene: Scene, db: Db, relay_dsn: str) -> None:
    out = relay_json("status", *target(relay_dsn, db), "--by-event-type")
    assert out["summary"]["pending"] == 6 and out["summary"]["dead"] == 1
    assert out["summary"]["blocked_aggregates"] == 1
    assert "done_estimate" in out["summary"]
    assert {e["event_type"] for e in out["by_event_type"]} == {"OrderPlaced", "OrderPaid", "EmailQueued"}
    proc = run_relay("status", *target(relay_dsn, db))
    assert proc.returncode == 0, proc.stderr
    assert "expired leases 1" in proc.stdout
    assert "done (est.)" in proc.stdout and "estimate from table statistics" in proc.stdout
    assert "blocked aggregates        1" in proc.stdout
    assert "EVENT TYPE" not in proc.stdout  # the breakdown only on request


def test_status_watch_redraws_in_place_until_ctrl_c(relay_dsn: str, names: OutboxNames) -> None:
    # On a terminal (a pty here) it clears and redraws; Ctrl-C ends it with exit code 0.
    primary, secondary = pty.openpty()
    proc = popen_with_ctrl_c(
        [RELAY, "status", "--dsn", relay_dsn, "--schema", names.schema, "--watch", "--interval", "200ms"],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=subprocess.PIPE,
        env=relay_env(),
    )
    os.close(secondary)
    screen = b""
    try:
        deadline = time.monotonic() + 15
        while screen.count(CLEAR_SCREEN.encode()) < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                screen += os.read(primary, 65536)
    finally:
        proc.send_signal(signal.SIGINT)
        # Keep reading the terminal until the process is gone: a frame it writes meanwhile
        # must not block on a full pty (which no signal would unblock).
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([primary], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    screen += os.read(primary, 65536)
        _, err = proc.communicate(timeout=1)
        os.close(primary)
    assert proc.returncode == 0, err
    assert screen.count(CLEAR_SCREEN.encode()) >= 3
    text = screen.decode()
    assert "refreshing every 200ms; Ctrl-C to stop" in text and f"outbox {names.schema}.outbox" in text
    assert b"Traceback" not in err


def test_status_watch_piped_prints_one_frame_after_another(relay_dsn: str, names: OutboxNames) -> None:
    proc = popen_with_ctrl_c(
        [RELAY, "status", "--dsn", relay_dsn, "--schema", names.schema, "--watch", "--interval", "200ms", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=relay_env(),
    )
    assert proc.stdout is not None
    frames = [json.loads(proc.stdout.readline()) for _ in range(2)]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert all(f["summary"]["pending"] == 0 for f in frames)


async def test_status_queries_never_scan_the_table(names: OutboxNames, relay_dsn: str, db: Db) -> None:
    """On a table whose bulk is done rows, every status, gauge and explain query reaches the
    outbox only through indexes (a seq scan would read the whole history)."""
    db.conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, done_at)"
            " SELECT 'order', 'x' || (g % 5000), 'OrderPlaced', '{{}}', 'done', now() FROM generate_series(1, 30000) g"
        ).format(db.table)
    )
    db.insert([("p", "OrderPlaced", {}), ("q", "EmailQueued", {})])
    db.conn.execute(sql.SQL("ANALYZE {}").format(db.table))
    params: dict[str, Any] = {
        "schema": names.schema,
        "table": names.table,
        "aggregate_id": "p",
        "event_types": None,
        "error": None,
        "created_after": None,
        "created_before": None,
        "limit": 100,
    }
    queries = [
        "status_summary",
        "status_attempts",
        "status_by_event_type",
        "explain_head",
        "explain_ordered",
        "explain_unordered",
        "dead_list",
    ]
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        for name in queries:
            cur = await conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + statement(names, name), params)
            row = await cur.fetchone()
            assert row is not None
            scans = list(_seq_scans(row[0][0]["Plan"]))
            assert names.table not in scans, (name, json.dumps(row[0], indent=1))


def _seq_scans(plan: dict[str, Any]) -> list[str]:
    found = [plan["Relation Name"]] if plan["Node Type"] == "Seq Scan" else []
    for child in plan.get("Plans", ()):
        found += _seq_scans(child)
    return found


async def test_explain_tells_each_state_apart(scene_store: OutboxStore, scene: Scene, db: Db, relay_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        blocked = await explain(conn, db.names, "a")
        assert blocked.state == "blocked"
        assert blocked.head is not None and blocked.head.id == scene.a[0] and blocked.head.status == "dead"
        assert blocked.waiting_behind == 2
        assert blocked.head.last_error is not None and "rejected" in blocked.head.last_error
        assert any(f"relay dead retry {scene.a[0]}" in h for h in blocked.hints)
        assert any(f"relay dead skip {scene.a[0]}" in h for h in blocked.hints)

        in_flight = await explain(conn, db.names, "b")
        assert in_flight.state == "in_flight" and in_flight.waiting_behind == 1
        assert in_flight.head is not None and in_flight.head.lease_owner == "w"
        assert in_flight.next_eligible_at == in_flight.head.lease_until

        assert (await explain(conn, db.names, "c")).state == "lease_expired"

        unordered_only = await explain(conn, db.names, "d")
        assert unordered_only.state == "idle" and unordered_only.unordered_pending == 2

        fresh = await explain(conn, db.names, "e")
        assert fresh.state == "awaiting_ingest" and fresh.not_numbered == 1

        await ingest(scene_store, db, "e")
        assert (await explain(conn, db.names, "e")).state == "ready"

        # b1's lease runs out, another worker takes it over, fails, and backs off for a minute
        db.expire_leases()
        reclaimed = await claim_until(scene_store, {scene.b[0], scene.e[0]}, owner="w2")
        await scene_store.finalize([Decision.retry(reclaimed[scene.b[0]], 60.0, "RetryableError: throttled")])
        backing_off = await explain(conn, db.names, "b")
        assert backing_off.state == "backing_off"
        assert backing_off.head is not None and backing_off.head.last_error == "RetryableError: throttled"
        assert backing_off.next_eligible_at is not None and backing_off.next_eligible_at > backing_off.at

        # everything of e delivered: idle
        [e1] = [m for m in reclaimed.values() if m.aggregate_id == "e"]
        await scene_store.finalize([Decision.published(e1)])
        assert (await explain(conn, db.names, "e")).state == "idle"

        with pytest.raises(ConfigError, match="aggregate 'nope' not found"):
            await explain(conn, db.names, "nope")


async def test_explain_cli_text_json_and_unknown_aggregate(scene: Scene, db: Db, relay_dsn: str) -> None:
    proc = run_relay("explain", "a", *target(relay_dsn, db))
    assert proc.returncode == 0, proc.stderr
    assert "aggregate 'a' in" in proc.stdout and "BLOCKED" in proc.stdout
    assert f"#{scene.a[0]}" in proc.stdout and "2 ordered messages" in proc.stdout
    assert f"relay dead retry {scene.a[0]} --schema {db.names.schema}" in proc.stdout
    out = relay_json("explain", "b", *target(relay_dsn, db))
    assert out["state"] == "in_flight" and out["head"]["id"] == scene.b[0] and out["waiting_behind"] == 1
    assert_one_line_error(run_relay("explain", "no-such-aggregate", *target(relay_dsn, db)), "not found")


def test_commands_refuse_an_outbox_without_the_ops_migration(relay_dsn: str, db: Db) -> None:
    db.conn.execute(
        sql.SQL("DELETE FROM {} WHERE version = 3").format(sql.Identifier(db.names.schema, "outbox_migrations"))
    )
    assert_one_line_error(run_relay("status", *target(relay_dsn, db)), "lacks migration 0003_ops", "relay migrate")
    assert_one_line_error(
        run_relay("status", "--dsn", relay_dsn, "--schema", "never_migrated"), "never_migrated.outbox is not set up"
    )


def test_status_bad_input(relay_dsn: str, db: Db) -> None:
    assert_one_line_error(run_relay("status", *target(relay_dsn, db), "--interval", "soon"), "invalid --interval")
    assert_one_line_error(run_relay("status", *target(relay_dsn, db), "--interval", "0s"), "invalid --interval")
    assert_one_line_error(run_relay("status"), "no database given")
    assert_one_line_error(run_relay("status", "--dsn", relay_dsn, "--table", "Bad-Name"), "invalid table name")


@pytest.mark.parametrize(
    ("rows", "expected", "text"),
    [
        ([], WakeupStatus(0, 0, False), "no relay listening"),
        ([("r:1", True, "1 hour"), ("r:2", True, "1 hour")], WakeupStatus(2, 2, True), "producers' inserts wake them"),
        (
            [("r:1", True, "1 hour"), ("r:2", False, "1 hour"), ("gone:1", False, "-1 minute")],
            WakeupStatus(2, 1, False),
            "producers send no wake-ups (a working relay",
        ),
    ],
)
async def test_status_shows_who_producers_would_wake(
    relay_dsn: str, db: Db, rows: list[tuple[str, bool, str]], expected: WakeupStatus, text: str
) -> None:
    record_listeners(db.conn, db.names, rows)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        status = await read_status(conn, db.names)
    assert status.wakeups == expected
    proc = run_relay("status", *target(relay_dsn, db))
    assert proc.returncode == 0, proc.stderr
    assert f"wake-ups       {expected.listening}" in proc.stdout or not expected.listening
    assert text in proc.stdout
    assert relay_json("status", *target(relay_dsn, db))["wakeups"] == {
        "listening": expected.listening,
        "idle": expected.idle,
        "producers_notify": expected.producers_notify,
    }
