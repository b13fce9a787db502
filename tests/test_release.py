"""`relay release`: an operator hands back a crashed worker's leases before they expire,
fenced by lease_version, dry run first; another relay then delivers the rows, in order."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.errors import ConfigError
from relay.message import Decision, OutboxMessage
from relay.ops.release import parse_ids
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.ops_helpers import PATIENCE_S, relay_json, run_parallel, target
from tests.producers import (
    Arrival,
    CommitLog,
    LockedProducers,
    create_producer_tables,
    order_violations,
    produce_unlocked,
)
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until_async

MakeStore = Callable[..., Awaitable[OutboxStore]]
LONG_LEASE = timedelta(hours=1)  # the crashed host's: nothing would move for an hour
DEAD_HOST = "deadhost:999"  # owners are host:pid:worker


@pytest.fixture
async def store(make_store: MakeStore) -> OutboxStore:
    return await make_store(OrderingMap(default_ordered=True, unordered=("Email*",)))


async def claim_as(store: OutboxStore, owner: str, want: set[int]) -> dict[int, OutboxMessage]:
    """Claim with the relay's own claim, as worker ``owner``, until ``want`` is held."""
    got: dict[int, OutboxMessage] = {}
    deadline = time.monotonic() + PATIENCE_S
    while not want <= set(got):
        claim = await store.claim(owner=owner, batch=100, lease=LONG_LEASE, max_attempts=3)
        got.update((m.id, m) for m in claim.messages)
        assert time.monotonic() < deadline, f"never claimed {sorted(want - set(got))}"
        await asyncio.sleep(0.02)
    assert set(got) == want, sorted(got)
    return got


async def deliver_with_a_log_relay(db: Db, relay_dsn: str, *, done: int) -> tuple[int | None, str, str]:
    """Run `relay start --broker log` until ``done`` rows are done (30 s at most), then
    SIGTERM it: its exit code, and its stdout (one line per message, in the order it
    published them) and stderr."""
    with RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "log", "--poll-interval", "100ms",
        env=relay_env(RELAY_DSN=relay_dsn),
    ) as relay:  # fmt: skip
        try:
            await wait_until_async(lambda: db.statuses().get("done", 0) >= done, timeout=30, interval=0.05)
        finally:
            await asyncio.to_thread(relay.stop)
        return relay.returncode, relay.stdout(), relay.stderr()


def lease_state(db: Db) -> dict[int, tuple[Any, ...]]:
    return {
        r["id"]: (r["status"], r["lease_owner"], r["lease_until"], r["lease_version"], r["attempts"], r["last_error"])
        for r in db.rows()
    }


def test_ids_are_ascii_digits_only() -> None:
    assert parse_ids(["3,1", "2", " 7 "]) == [1, 2, 3, 7]
    for bad in ("²", "\u0661", "1,,2", "-1", "0", "1.5", "", "0x10", "9" * 20, str(2**63)):
        with pytest.raises(ConfigError, match="invalid --ids entry"):
            parse_ids([bad])


async def test_release_by_owner_dry_run_then_yes_fences_the_old_owner_and_another_relay_delivers(
    store: OutboxStore, db: Db, relay_dsn: str
) -> None:
    t = target(relay_dsn, db)
    [live] = db.insert([("b", "OrderPlaced", {})])
    await claim_as(store, "livehost:1:0", {live})
    a = db.insert([("a", "OrderPlaced", {"n": i}) for i in range(3)])
    mails = db.insert([("m", "EmailSent", {"n": 0})])
    # The crashed host's two workers: one holds the head of aggregate a (a[1] and a[2] wait
    # behind it) and a mail, the other a second mail.
    held = await claim_as(store, f"{DEAD_HOST}:0", {a[0], mails[0]})
    mails += db.insert([("m", "EmailSent", {"n": 1})])
    held |= await claim_as(store, f"{DEAD_HOST}:1", {mails[1]})
    before = lease_state(db)

    dry = run_relay("release", "--owner", DEAD_HOST, *t)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"dry run: would release 3 leased messages of {db.names.schema}.outbox held by")
    listed = [w[0] for w in (line.split() for line in dry.stdout.splitlines()[2:]) if w and w[0].isdigit()]
    assert listed == [str(i) for i in sorted((a[0], *mails))], dry.stdout
    assert f"{DEAD_HOST}:0" in dry.stdout and f"{DEAD_HOST}:1" in dry.stdout
    assert re.search(r"\(in (59\.\d|60)m\)", dry.stdout), dry.stdout  # the lease expiry, by the database clock
    assert "ordered aggregates that would resume in order: a" in dry.stdout
    assert "nothing changed; run again with --yes" in dry.stdout
    assert lease_state(db) == before  # a dry run changes nothing

    proc = run_relay("release", "--owner", DEAD_HOST, "--yes", "--by", "alice", "--reason", "host terminated", *t)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Released 3 leased messages")
    after = lease_state(db)
    for i in (a[0], *mails):
        status, owner, until, version, attempts, _ = after[i]
        assert (status, owner, until) == ("pending", None, None)
        assert version == held[i].lease_version + 1
        assert attempts == 1  # the crashed claim still counts, as when a lease expires
        row = db.row(i)
        assert (row["resolution"], row["resolved_by"], row["resolved_note"]) == ("released", "alice", "host terminated")
    assert after[live] == before[live]  # another owner's lease is not touched
    assert {i: after[i] for i in a[1:]} == {i: before[i] for i in a[1:]}
    assert f"outbox_id={a[0]}" in proc.stderr and "lease released by alice" in proc.stderr

    # The old owner comes back after all: its finalize, at the version it claimed, writes nothing.
    refused = await store.finalize([Decision.published(m) for m in held.values()])
    assert refused == set(held)
    assert lease_state(db) == after

    # Another relay delivers the released rows, the ordered ones in order.
    code, out, err = await deliver_with_a_log_relay(db, relay_dsn, done=5)
    assert code == 0, err
    assert db.statuses() == {"done": 5, "processing": 1}, err  # livehost's lease still runs
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(m["outbox_id"] for m in lines) == sorted([*a, *mails])
    ordered = [(m["outbox_id"], m["aggregate_seq"]) for m in lines if m["aggregate_id"] == "a"]
    assert ordered == [(a[0], 1), (a[1], 2), (a[2], 3)]
    assert {m["lease_version"] for m in lines if m["outbox_id"] == a[0]} == {held[a[0]].lease_version + 2}


async def test_release_by_ids_reports_what_it_will_not_touch(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    t = target(relay_dsn, db)
    [other] = db.insert([("b", "OrderPlaced", {})])
    await claim_as(store, "livehost:1:0", {other})
    ids = db.insert([("a", "OrderPlaced", {}), ("a", "OrderPaid", {}), ("m", "EmailSent", {})])
    held = await claim_as(store, f"{DEAD_HOST}:0", {ids[0], ids[2]})
    before = lease_state(db)
    unknown = max(before) + 1000

    nothing = run_relay("release", "--owner", DEAD_HOST, "--ids", f"{other},{ids[1]},{unknown}", "--yes", *t)
    err = assert_one_line_error(
        nothing,
        "nothing to release",
        f"{other}: held by livehost:1:0, not {DEAD_HOST}",
        f"{ids[1]}: not processing (status pending)",
        f"{unknown}: unknown id",
    )
    assert f"{DEAD_HOST}:0 (2)" in err and "livehost:1:0 (1)" in err  # who does hold leases
    assert lease_state(db) == before

    result = relay_json("release", "--ids", f"{ids[0]},{unknown}", "--ids", str(ids[1]), "--yes", *t)
    assert [h["id"] for h in result["released"]] == [ids[0]]
    assert result["refused"] == [
        {"id": ids[1], "reason": "not processing (status pending)"},
        {"id": unknown, "reason": "unknown id"},
    ]
    assert result["dry_run"] is False and result["released"][0]["then"] == "pending"
    assert db.row(ids[0])["status"] == "pending"
    assert db.row(ids[0])["lease_version"] == held[ids[0]].lease_version + 1
    assert lease_state(db)[ids[2]] == before[ids[2]]  # not named: not touched
    assert lease_state(db)[other] == before[other]


async def test_a_release_on_the_last_attempt_sends_to_dead_like_the_reaper(
    store: OutboxStore, db: Db, relay_dsn: str
) -> None:
    t = target(relay_dsn, db)
    ids = db.insert([("c", "OrderPlaced", {}), ("c", "OrderPaid", {})])
    await claim_as(store, "crashed:7:0", {ids[0]})
    proc = run_relay("release", "--owner", "crashed:7:0", "--max-attempts", "1", *t)
    assert "dead (attempts spent, max 1)" in proc.stdout, proc.stderr
    assert "resume in order" not in proc.stdout
    proc = run_relay("release", "--owner", "crashed", "--yes", *t, env=relay_env(RELAY_MAX_ATTEMPTS="1"))
    assert proc.returncode == 0, proc.stderr
    row = db.row(ids[0])
    assert (row["status"], row["lease_owner"], row["attempts"]) == ("dead", None, 1)
    assert row["last_error"] == "lease released by an operator after 1 attempts (held by crashed:7:0)"
    # The dead head stops its aggregate, as any dead head does, until retried or skipped.
    heads = db.conn.execute(
        sql.SQL("SELECT head_id, ready_at FROM {} WHERE aggregate_id = 'c'").format(
            sql.Identifier(db.names.schema, "outbox_heads")
        )
    ).fetchone()
    assert heads == (ids[0], None)
    claim = await store.claim(owner="w", batch=10, lease=LONG_LEASE, max_attempts=3)
    assert claim.messages == []


async def test_bad_release_requests_get_one_line(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    t = target(relay_dsn, db)
    cases = [
        (["--ids", "²"], "invalid --ids entry '²'"),
        (["--ids", "\u0661"], "invalid --ids entry '\u0661'"),  # an Arabic-Indic digit one
        (["--ids", "1,,2"], "invalid --ids entry ''"),
        ([], "say whose leases to release"),
        (["--owner", " "], "invalid --owner"),
        (["--owner", "nobody", "--yes"], "no processing messages held by 'nobody'"),
        (["--owner", "x", "--max-attempts", "0"], "--max-attempts"),
    ]
    procs = run_parallel(*(["release", *args, *t] for args, _ in cases))
    for (_, needle), proc in zip(cases, procs, strict=True):
        assert_one_line_error(proc, needle)


@pytest.mark.parametrize("producers", ["locked", "unlocked"])
async def test_released_ordered_rows_are_delivered_in_commit_order(
    producers: str, store: OutboxStore, db: Db, pg_dsn: str, producer_dsn: str, relay_dsn: str
) -> None:
    """The crashed host held the head of each aggregate, written by producers that lock the
    aggregate (the design reference's pattern) or that do not; after `relay release --yes`
    another relay delivers every aggregate in the order its transactions committed, as the
    producers observed it, with aggregate_seq 1, 2, 3, ..."""
    aggregates = ["order-1", "order-2"]
    create_producer_tables(pg_dsn, db.names, aggregates, producer_dsn=producer_dsn)
    log = CommitLog()
    if producers == "locked":
        LockedProducers(producer_dsn, db.names, aggregates, log, threads=2, rollback_share=0.0, seed=3).run(6)
    else:
        produce_unlocked(producer_dsn, db.names, aggregates, log, rounds=6, seed=3, unordered_type=None)
    expected = log.expected()
    heads = {order[0] for order in expected.values()}
    await claim_as(store, f"{DEAD_HOST}:0", heads)

    proc = run_relay("release", "--owner", DEAD_HOST, "--yes", *target(relay_dsn, db))
    assert proc.returncode == 0, proc.stderr
    code, out, err = await deliver_with_a_log_relay(db, relay_dsn, done=len(log.ids()))
    assert code == 0, err
    received = [json.loads(line) for line in out.splitlines()]  # the broker's order
    arrivals = [Arrival(m["outbox_id"], m["aggregate_id"]) for m in received]
    assert {a.outbox_id for a in arrivals} == log.ids()
    assert not order_violations(expected, arrivals)
    for aggregate, order in expected.items():
        seqs = [m["aggregate_seq"] for m in received if m["aggregate_id"] == aggregate]
        assert seqs == list(range(1, len(order) + 1)), (aggregate, seqs)
