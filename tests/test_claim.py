"""The claim and the fenced finalize against a real PostgreSQL: the design reference's races."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from relay.db.dispatch import OutboxStore
from relay.db.settings import store_ordering
from relay.message import Decision
from relay.ordering import OrderingMap
from tests.conftest import Db

LONG = timedelta(seconds=30)


async def claim(store: OutboxStore, owner: str, batch: int = 10, lease: timedelta = LONG, max_attempts: int = 3):
    result = await store.claim(owner=owner, batch=batch, lease=lease, max_attempts=max_attempts)
    return result.messages


async def test_four_workers_claiming_seven_at_a_time_get_each_row_once(relay_dsn: str, db: Db, names: Any) -> None:
    from psycopg_pool import AsyncConnectionPool

    # Each worker gets its own pool so the four claims really run on four connections at once.
    pools = [
        AsyncConnectionPool(relay_dsn, min_size=1, max_size=1, open=False, kwargs={"autocommit": True})
        for _ in range(4)
    ]
    for p in pools:
        await p.open(wait=True)
    stores = [OutboxStore(p, names) for p in pools]
    async with pools[0].connection() as conn:
        await store_ordering(conn, names, OrderingMap(default_ordered=False))
    db.insert((f"agg-{i}", "Ping", {"i": i}) for i in range(200))
    got: dict[str, list[int]] = {f"w{i}": [] for i in range(4)}

    async def worker(name: str, store: OutboxStore) -> None:
        while True:
            batch = await claim(store, name, batch=7)
            if not batch:
                return
            got[name].extend(m.id for m in batch)
            await asyncio.sleep(0)

    try:
        await asyncio.gather(*(worker(f"w{i}", s) for i, s in enumerate(stores)))
    finally:
        for p in pools:
            await p.close()
    everything = [i for ids in got.values() for i in ids]
    assert len(everything) == 200
    assert len(set(everything)) == 200
    assert sum(1 for ids in got.values() if ids) >= 2, "the claims did not run concurrently"
    assert db.statuses() == {"processing": 200}


async def test_claim_writes_owner_lease_version_and_attempt(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {"x": 1})])
    [m] = await claim(store, "A", lease=timedelta(seconds=45))
    row = db.row(oid)
    assert (m.id, m.lease_version, m.attempt) == (oid, 1, 1)
    assert m.payload() == {"x": 1}
    assert row["status"] == "processing"
    assert row["lease_owner"] == "A"
    assert row["lease_version"] == 1 and row["attempts"] == 1
    lease = (row["lease_until"] - row["created_at"]).total_seconds()
    assert 44 <= lease <= 46  # by the database clock, from the claim


async def test_crashed_worker_keeps_the_row_for_its_lease_then_loses_it_to_the_fence(
    store: OutboxStore, db: Db
) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    # A second of lease: long enough that B's first claim comes inside it on a loaded
    # machine (300 ms was not, with other suites running beside this one).
    [a] = await claim(store, "A", lease=timedelta(seconds=1))
    assert await claim(store, "B") == []  # A's lease holds: nobody else may take it
    await asyncio.sleep(1.1)
    [b] = await claim(store, "B")
    assert b.id == a.id == oid
    assert b.lease_version == a.lease_version + 1
    assert b.attempt == a.attempt + 1
    assert db.row(oid)["lease_owner"] == "B"

    assert await store.finalize([Decision.published(a)]) == {oid}  # A's late write is refused
    assert db.row(oid)["status"] == "processing"  # ...and changed nothing
    assert await store.finalize([Decision.published(b)]) == set()
    row = db.row(oid)
    assert row["status"] == "done" and row["done_at"] is not None and row["lease_until"] is None


async def test_expired_lease_without_takeover_still_finalizes(store: OutboxStore, db: Db) -> None:
    # Correctness rests on the generation, not the clock: nobody took over, so A's work counts.
    [oid] = db.insert([("a", "Ping", {})])
    [a] = await claim(store, "A")
    db.expire_leases()
    assert await store.finalize([Decision.published(a)]) == set()
    assert db.row(oid)["status"] == "done"


async def test_row_crashed_max_attempts_times_goes_dead_and_is_never_claimed_again(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Poison", {})])
    for attempt in range(1, 4):
        [m] = await claim(store, f"W{attempt}", max_attempts=3)
        assert m.attempt == attempt
        db.expire_leases()  # the worker died while publishing
    result = await store.claim(owner="W4", batch=10, lease=LONG, max_attempts=3)
    assert result.messages == []
    assert [r.id for r in result.reaped] == [oid]
    row = db.row(oid)
    assert row["status"] == "dead" and row["attempts"] == 3 and row["lease_until"] is None
    assert "lease expired after 3 attempts" in row["last_error"]
    assert await claim(store, "W5", max_attempts=3) == []
    assert await claim(store, "W6", max_attempts=10) == []  # dead stays dead, whatever the limit


async def test_batched_finalize_is_fenced_row_by_row(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "Ping", {}), ("b", "Ping", {}), ("c", "Ping", {})])
    first = await claim(store, "A")
    # Only the middle row's lease runs out, and B takes it over.
    db.conn.execute(
        psycopg.sql.SQL("UPDATE {} SET lease_until = now() - interval '1s' WHERE id = %s").format(db.table),
        (ids[1],),
    )
    [b] = await claim(store, "B")
    assert b.id == ids[1] and b.lease_version == 2

    refused = await store.finalize([Decision.published(m) for m in first])
    assert refused == {ids[1]}
    assert [r["status"] for r in db.rows()] == ["done", "processing", "done"]
    middle = db.row(ids[1])
    assert middle["lease_owner"] == "B" and middle["lease_version"] == 2


async def test_finalize_of_a_row_that_is_gone_is_refused_not_raised(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    [m] = await claim(store, "A")
    db.conn.execute(psycopg.sql.SQL("DELETE FROM {}").format(db.table))
    assert await store.finalize([Decision.published(m)]) == {oid}


async def test_backed_off_rows_wait_for_available_at(store: OutboxStore, db: Db) -> None:
    db.insert([("a", "Ping", {})])
    [m] = await claim(store, "A")
    await store.finalize([Decision.retry(m, 60.0, "RetryableError: nope")])
    assert await claim(store, "B") == []
    db.make_available()
    [again] = await claim(store, "B")
    assert again.id == m.id and again.attempt == 2


async def wal_syncs(conn: psycopg.AsyncConnection[Any]) -> int:
    """The cluster's WAL flushes so far, with this connection's own counted: a backend
    reports its statistics at most once a second unless told to at its next transaction."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")
    cur = await conn.execute("SELECT wal_sync FROM pg_stat_wal")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.serial  # pg_stat_wal counts the whole cluster's flushes: nothing else may commit meanwhile
async def test_finalize_commits_without_waiting_for_a_wal_flush_and_claims_do(
    relay_dsn: str, db: Db, names: Any
) -> None:
    """Each claim waits for its WAL to reach disk (a fencing token must never be handed out
    twice, not even after a crash of the database); a finalize does not (a lost outcome is
    a message delivered again). Counted in flushes of the WAL, as the server reports them,
    on a pool of one connection, whose reports the count then includes."""
    from psycopg_pool import AsyncConnectionPool

    db.insert((f"agg-{i}", "Ping", {"i": i}) for i in range(30))
    async with AsyncConnectionPool(relay_dsn, min_size=1, max_size=1, kwargs={"autocommit": True}) as pool:
        store = OutboxStore(pool, names)

        async def syncs() -> int:
            async with pool.connection() as conn:
                return await wal_syncs(conn)

        before = await syncs()
        claimed = [m for _ in range(30) for m in await claim(store, "A", batch=1)]
        claims_synced = await syncs() - before
        assert len(claimed) == 30
        before = await syncs()
        for m in claimed:
            assert await store.finalize([Decision.published(m)]) == set()
        finalizes_synced = await syncs() - before
    assert db.statuses() == {"done": 30}
    assert claims_synced >= 30, f"the claims waited for {claims_synced} flushes: the count cannot tell"
    assert finalizes_synced < 10, f"30 finalizes waited for {finalizes_synced} WAL flushes"


async def test_no_statement_of_the_ingest_plans_a_disabled_scan(store: OutboxStore, db: Db) -> None:
    """Under ingest_plans (no sequential scans) a statement that must still scan a table
    costs as disabled (10^10), and that cost alone makes a session with JIT on (the
    database's default; the relay's own sessions turn it off, an embedding's may not)
    compile the statement: 0.8 s of a 1 ms ingest, which made every claim run out a 1 s
    lease. Each statement's estimate stays below the JIT threshold."""
    db.insert([("a", "E", {}), ("b", "E", {})])
    async with store.pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT current_setting('jit_above_cost')::float8")
        threshold = (await cur.fetchone() or (0.0,))[0]
        await conn.execute(store.query("ingest_plans"))
        for name in ("ingest_lock", "ingest", "ingest_by_id"):
            cur = await conn.execute(
                "EXPLAIN (FORMAT JSON) " + store.query(name).as_string(conn), {"transactions": 5000}
            )
            [[plan]] = await cur.fetchall()
            cost = plan[0]["Plan"]["Total Cost"]
            assert cost < threshold, (name, cost)


async def test_claims_grow_while_they_come_back_full_and_start_again_after_a_short_one(
    store: OutboxStore, db: Db
) -> None:
    from relay.testing import InMemoryPublisher
    from relay.worker import Worker, WorkerConfig

    db.insert((f"a{i}", "Ping", {"i": i}) for i in range(10 + 20 + 40 + 40 + 15))
    publisher = InMemoryPublisher()
    config = WorkerConfig(batch_size=10, max_batch_size=40)
    worker = Worker(store=store, publisher=publisher, owner="w", config=config)
    sizes = [await worker.run_once() for _ in range(6)]
    # 10, then twice as many after each full claim up to the ceiling; 15 left is a short
    # claim, after which the size is the configured one again.
    assert sizes == [10, 20, 40, 40, 15, 0]
    db.insert((f"b{i}", "Ping", {"i": i}) for i in range(25))
    assert await worker.run_once() == 10
    assert len(publisher.delivered_ids()) == 10 + 20 + 40 + 40 + 15 + 10
