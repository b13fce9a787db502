"""`relay dead list|retry|skip` against a real PostgreSQL, through the real console script."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import click
import psycopg
import pytest

from relay import ConfigError, PermanentError
from relay.cli.dead import _selection
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.readmodel import DeadFilter
from relay.ops.deadletters import group_dead, list_dead
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.helpers import make_worker
from tests.ops_helpers import (
    claim_until,
    fingerprint,
    group_key,
    kill,
    relay_json,
    run_parallel,
    run_until,
    target,
)
from tests.relay_process import assert_one_line_error, run_relay

MakeStore = Callable[..., Awaitable[OutboxStore]]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("order 41 too large (262211 bytes)", "order 42 too large (300002 bytes)"),
        ("queue 'orders-eu' not found", "queue 'orders-us' not found"),
        ("request 9f86d081884c7d65 failed", "request 0a1b2c3d4e5f6071 failed"),
        ("id 0x7ffe12 bad", "id 0x1 bad"),
        ("uuid 123e4567-e89b-12d3-a456-426614174000 gone", "uuid 00000000-0000-0000-0000-000000000000 gone"),
        ("PermanentError: boom\nTraceback: line 12", "PermanentError: boom\nTraceback: line 99"),
        ("the producer's headers are refused: header 'x1'", "the producer's headers are refused: header 'y2'"),
    ],
)
def test_fingerprint_ignores_what_varies_per_message(a: str, b: str, pg_dsn: str, names: OutboxNames) -> None:
    assert fingerprint(pg_dsn, names, a) == fingerprint(pg_dsn, names, b)
    assert group_key(pg_dsn, names, a) == group_key(pg_dsn, names, b)


def test_fingerprint_keeps_what_tells_errors_apart(pg_dsn: str, names: OutboxNames) -> None:
    assert fingerprint(pg_dsn, names, "queue not found") != fingerprint(pg_dsn, names, "access denied")
    assert fingerprint(pg_dsn, names, None) == fingerprint(pg_dsn, names, "") == "(no error recorded)"
    assert len(group_key(pg_dsn, names, "x")) == 16
    # An apostrophe inside a word is a letter, not a quote: the words after it are kept
    # (they were replaced up to the next quote, merging errors that differ there).
    assert fingerprint(pg_dsn, names, "the producer's headers are refused: header 'x'") == (
        "the producer's headers are refused: header '?'"
    )
    assert fingerprint(pg_dsn, names, "the producer's headers are refused") != fingerprint(
        pg_dsn, names, "the producer's payload is refused"
    )


@pytest.fixture
async def store(make_store: MakeStore) -> OutboxStore:
    return await make_store(OrderingMap(default_ordered=True, unordered=("Email*",)))


async def make_dead(store: OutboxStore, db: Db) -> dict[str, list[int]]:
    """Dead heads of ordered aggregates o1, o2 (too large, rows behind), o3 (refused), and
    a dead unordered email; what is behind the heads stays pending."""
    o1 = db.insert([("o1", "OrderPlaced", {}), ("o1", "OrderPaid", {}), ("o1", "OrderShipped", {})])
    o2 = db.insert([("o2", "OrderPlaced", {}), ("o2", "OrderPaid", {})])
    o3 = db.insert([("o3", "OrderPaid", {})])
    mail = db.insert([("m", "EmailQueued", {})])
    claimed = await claim_until(store, {o1[0], o2[0], o3[0], mail[0]})
    assert set(claimed) == {o1[0], o2[0], o3[0], mail[0]}
    await kill(store, [claimed[o1[0]]], f"PermanentError: order {o1[0]} too large (262211 bytes)")
    await kill(store, [claimed[o2[0]]], f"PermanentError: order {o2[0]} too large (300002 bytes)")
    await kill(store, [claimed[o3[0]]], "PermanentError: access denied for queue 'orders-eu'")
    await kill(store, [claimed[mail[0]]], "PermanentError: mailbox 'x@example.com' unknown")
    return {"o1": o1, "o2": o2, "o3": o3, "mail": mail}


async def test_list_filters_and_groups(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    dead = await make_dead(store, db)
    heads = [dead["o1"][0], dead["o2"][0], dead["o3"][0], dead["mail"][0]]
    now = datetime.now(UTC)
    filters = [
        (DeadFilter(), heads),
        (DeadFilter(event_types=("OrderPaid",)), [dead["o3"][0]]),
        (DeadFilter(event_types=("OrderPaid", "EmailQueued")), [dead["o3"][0], dead["mail"][0]]),
        (DeadFilter(aggregate_id="o2"), [dead["o2"][0]]),
        (DeadFilter(error="TOO LARGE"), [dead["o1"][0], dead["o2"][0]]),
        (DeadFilter(created_after=now - timedelta(hours=1)), heads),
        (DeadFilter(created_before=now - timedelta(hours=1)), []),
        (DeadFilter(created_after=now - timedelta(hours=1), event_types=("EmailQueued",)), [dead["mail"][0]]),
    ]
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        for flt, expected in filters:
            assert [m.id for m in (await list_dead(conn, db.names, flt)).messages] == expected, flt
        page = await list_dead(conn, db.names, DeadFilter(), limit=1)
        assert len(page.messages) == 1 and page.total == 4

    t = target(relay_dsn, db)
    as_json, grouped_json, text, table, some, empty = run_parallel(
        ["dead", "list", *t, "--json"],
        ["dead", "list", *t, "--group", "--json"],
        ["dead", "list", *t, "--group"],
        ["dead", "list", *t],
        ["dead", "list", *t, "--event-type", "OrderPaid", "--error", "denied", "--newer-than", "1h", "--json"],
        ["dead", "list", *t, "--aggregate", "nobody"],
    )
    rows = json.loads(as_json.stdout)
    assert [m["id"] for m in rows["messages"]] == heads and rows["total"] == 4
    assert [m["blocking"] for m in rows["messages"]] == [True, True, True, False]
    assert [m["id"] for m in json.loads(some.stdout)["messages"]] == [dead["o3"][0]]
    grouped = json.loads(grouped_json.stdout)
    groups = grouped["groups"]
    assert (grouped["total_groups"], grouped["total"], grouped["page"], grouped["pages"]) == (3, 4, 1, 1)
    assert [(g["count"], g["blocking"]) for g in groups] == [(2, 2), (1, 1), (1, 0)]
    assert (groups[0]["first_id"], groups[0]["last_id"]) == (dead["o1"][0], dead["o2"][0])
    assert groups[0]["fingerprint"] == "PermanentError: order <n> too large (<n> bytes)"
    assert text.returncode == 0, text.stderr
    assert groups[0]["key"] in text.stdout and "4 dead messages in 3 groups" in text.stdout
    assert "BLOCKS" in table.stdout and "3 of these block their ordered aggregate" in table.stdout
    assert empty.returncode == 0 and "no dead messages match aggregate 'nobody'" in empty.stdout


def test_selection_rules() -> None:
    with pytest.raises(click.UsageError, match="say which dead messages"):
        _selection((), None, False, {})
    with pytest.raises(click.UsageError, match="not more than one"):
        _selection(("12",), None, True, {})
    with pytest.raises(click.UsageError, match="not more than one"):
        _selection(("12",), None, False, {"f_event_types": ("X",)})
    with pytest.raises(ConfigError, match="invalid id 'abc'"):
        _selection(("abc",), None, False, {})
    with pytest.raises(ConfigError, match="invalid --group"):
        _selection((), "zz", False, {})
    with pytest.raises(ConfigError, match="invalid --newer-than"):
        _selection((), None, False, {"f_newer": "last tuesday"})
    assert _selection(("41", "42"), None, False, {}) == ([41, 42], DeadFilter(), None)


async def test_bad_input_through_the_console_script(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    t = target(relay_dsn, db)
    cases = [
        (["list", "--newer-than", "last tuesday"], "invalid --newer-than"),
        (["list", "--newer-than", "1h", "--older-than", "2h"], "leave no time between them"),
        (["retry", "12", "--all"], "not more than one"),
        (["retry", "abc"], "invalid id 'abc'"),
        (["retry", "--group", "0000000000000000"], "no dead messages match group 0000000000000000"),
        (["retry", "--group", "00000000"], "expected the 16-character key"),
        (["skip", "--event-type", "NoSuchType", "--reason", "r"], "no dead messages match event type 'NoSuchType'"),
    ]
    procs = run_parallel(*(["dead", *args, *t] for args, _ in cases))
    for (_, needle), proc in zip(cases, procs, strict=True):
        assert_one_line_error(proc, needle)


async def test_redrive_of_a_dead_head_resumes_its_aggregate_in_order(
    store: OutboxStore, db: Db, relay_dsn: str
) -> None:
    ids = db.insert([("a", "OrderPlaced", {"n": i}) for i in range(4)])
    first_try = {ids[0]}

    def fail_first(m):  # type: ignore[no-untyped-def]
        return PermanentError("rejected") if m.id in first_try else None

    worker, pub = make_worker(store, fail_first)
    await run_until(worker, lambda: db.row(ids[0])["status"] == "dead")
    for _ in range(3):
        await worker.run_once()
    assert pub.delivered_ids() == []  # the rows behind the dead head wait
    t = target(relay_dsn, db)

    dry = run_relay("dead", "retry", str(ids[0]), *t, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "dry run: would re-drive 1 dead message" in dry.stdout and "nothing changed" in dry.stdout
    assert db.row(ids[0])["status"] == "dead"

    proc = run_relay("dead", "retry", str(ids[0]), *t, "--by", "alice", "--reason", "receiver fixed")
    assert proc.returncode == 0, proc.stderr
    assert "Re-drove 1 dead message to pending" in proc.stdout and "resume in order: a" in proc.stdout
    row = db.row(ids[0])
    assert (row["status"], row["attempts"], row["resolution"], row["resolved_by"], row["resolved_note"]) == (
        "pending",
        0,
        "retried",
        "alice",
        "receiver fixed",
    )
    assert row["last_error"] == "PermanentError: rejected"  # kept for the record

    first_try.clear()
    await run_until(worker, lambda: len(pub.delivered) == len(ids))
    assert pub.delivered_ids() == ids  # the head first, then the rest, in order
    assert db.row(ids[0])["attempts"] == 1
    # the re-drive was logged with the message fields
    assert f"outbox_id={ids[0]}" in proc.stderr and "aggregate_id=a" in proc.stderr and "lease_version=" in proc.stderr


async def test_skip_unblocks_the_aggregate(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    ids = db.insert([("a", "OrderPlaced", {}), ("a", "OrderPaid", {}), ("a", "OrderShipped", {})])
    worker, pub = make_worker(store, lambda m: PermanentError("poison") if m.id == ids[0] else None)
    await run_until(worker, lambda: db.row(ids[0])["status"] == "dead")
    for _ in range(3):
        await worker.run_once()
    assert pub.delivered_ids() == []
    t = target(relay_dsn, db)

    assert_one_line_error(run_relay("dead", "skip", str(ids[0]), *t), "needs --reason")
    dry = run_relay("dead", "skip", str(ids[0]), *t, "--reason", "duplicate", "--dry-run")
    assert dry.returncode == 0 and "dry run: would skip 1 dead message" in dry.stdout
    assert db.row(ids[0])["status"] == "dead"

    proc = run_relay("dead", "skip", str(ids[0]), *t, "--reason", "duplicate of #7", "--by", "bob@ops")
    assert proc.returncode == 0, proc.stderr
    assert "Skipped 1 dead message" in proc.stdout and "move on to their next message: a" in proc.stdout
    row = db.row(ids[0])
    assert row["status"] == "done" and row["done_at"] is not None
    assert (row["resolution"], row["resolved_by"], row["resolved_note"]) == ("skipped", "bob@ops", "duplicate of #7")

    await run_until(worker, lambda: len(pub.delivered) == 2)
    assert pub.delivered_ids() == ids[1:]


async def test_writes_refuse_unknown_and_not_dead_ids_and_change_nothing(
    store: OutboxStore, db: Db, relay_dsn: str
) -> None:
    dead = await make_dead(store, db)
    t = target(relay_dsn, db)
    behind = dead["o1"][1]  # pending behind the dead head
    before = db.rows()
    ids = [str(dead["o1"][0]), str(behind), "999999"]
    commands = [["retry"], ["retry", "--dry-run"], ["skip", "--reason", "x"], ["skip", "--reason", "x", "--dry-run"]]
    for proc in run_parallel(*(["dead", *c, *ids, *t] for c in commands)):
        err = assert_one_line_error(
            proc, "nothing changed", f"{behind}: not dead (status pending)", "999999: unknown id"
        )
        assert str(dead["o1"][0]) + ":" not in err  # the valid id is not refused, just not touched
    assert db.rows() == before


async def test_retry_and_skip_by_group_filter_and_all(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    dead = await make_dead(store, db)
    t = target(relay_dsn, db)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        [too_large, *_] = (await group_dead(conn, db.names, DeadFilter())).groups
    dry = relay_json("dead", "retry", "--group", too_large.key, *t, "--dry-run")
    assert [c["id"] for c in dry["changed"]] == [dead["o1"][0], dead["o2"][0]] and dry["dry_run"] is True
    assert len(db.rows("status = 'dead'")) == 4

    done = relay_json("dead", "retry", "--group", too_large.key, *t)
    assert [c["id"] for c in done["changed"]] == [dead["o1"][0], dead["o2"][0]]
    assert [r["id"] for r in db.rows("status = 'dead'")] == [dead["o3"][0], dead["mail"][0]]

    proc = run_relay("dead", "skip", "--event-type", "EmailQueued", "--reason", "mailbox gone", *t)
    assert proc.returncode == 0, proc.stderr
    assert [r["id"] for r in db.rows("status = 'dead'")] == [dead["o3"][0]]

    proc = run_relay("dead", "retry", "--all", *t)
    assert proc.returncode == 0, proc.stderr
    assert db.rows("status = 'dead'") == []
    assert_one_line_error(run_relay("dead", "retry", "--all", *t), "no dead messages match")
