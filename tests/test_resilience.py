"""Guards of ordered delivery and the loop's behaviour when the broker or the database fails."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import BrokerUnavailable
from relay.breaker import CircuitBreaker
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.runner import run_relay
from relay.testing import STALL, InMemoryPublisher
from tests.conftest import Db
from tests.helpers import make_worker, settings_for, terminate_relay_sessions
from tests.relay_process import wait_until_async

# terminate_relay_sessions ends every relay session in the database, other tests' too.
pytestmark = pytest.mark.serial


def test_the_database_refuses_two_ordered_messages_of_one_aggregate_in_flight(db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {})])
    lease = sql.SQL(
        "UPDATE {} SET status = 'processing', lease_until = now() + interval '1 minute' WHERE id = %s"
    ).format(db.table)
    db.conn.execute(lease, (ids[0],))
    with pytest.raises(psycopg.errors.UniqueViolation):
        db.conn.execute(lease, (ids[1],))  # whatever a claim query got wrong, this cannot happen


def test_unordered_messages_of_one_aggregate_may_all_be_in_flight(db: Db) -> None:
    db.conn.execute(
        sql.SQL("UPDATE {} SET ord_default = false").format(sql.Identifier(db.names.schema, "outbox_settings"))
    )
    db.insert([("a", "E", {}), ("a", "E", {})])
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'processing', lease_until = now() + interval '1 minute'").format(db.table)
    )
    assert db.statuses() == {"processing": 2}


async def test_publish_is_abandoned_before_the_lease_expires(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "E", {})])
    # A publish timeout longer than the lease allows (the CLI would refuse it); the lease
    # deadline must still win: 1 s lease - 0.1 s margin.
    worker, _ = make_worker(store, lambda m: STALL, lease=timedelta(seconds=1), publish_timeout=timedelta(seconds=30))
    started = time.monotonic()
    await worker.run_once()
    elapsed = time.monotonic() - started
    assert 0.7 < elapsed < 1.0
    row = db.row(oid)
    assert row["status"] == "pending"  # finalized by its own lease holder: not lost, not stale
    assert "publish timed out" in row["last_error"]


async def test_outage_stops_claims_spends_no_attempt_and_resumes(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ids = db.insert((f"agg-{i}", "E", {"i": i}) for i in range(50))
    broker_down = True
    publisher = InMemoryPublisher(script=lambda m: BrokerUnavailable("queue q does not exist") if broker_down else None)
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=3, batch_size=10, max_attempts=2)
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    await asyncio.sleep(3.0)  # an outage far longer than max_attempts=2 could survive unguarded
    seen_during_outage = len(publisher.attempts)
    rows = db.rows()
    assert all(r["status"] == "pending" and r["attempts"] == 0 for r in rows)
    # The breaker opened after the first refused batches: probes of one message follow, a
    # handful a second, instead of every worker claiming full batches.
    assert seen_during_outage < 3 * 10 + 20
    broker_down = False
    assert await wait_until_async(lambda: db.statuses() == {"done": 50}, timeout=15)
    stop.set()
    await task
    assert sorted(publisher.delivered_ids()) == ids
    assert all(r["attempts"] == 1 for r in db.rows())  # only the successful claim counted
    messages = [r.getMessage() for r in caplog.records]
    assert sum("broker unavailable, pausing claims" in m for m in messages) == 1
    assert any("broker is back" in m for m in messages)


async def test_breaker_probe_with_no_rows_keeps_it_open() -> None:
    clock = [0.0]
    breaker = CircuitBreaker(clock=lambda: clock[0])
    stop = asyncio.Event()
    assert await breaker.permit(stop) is None
    breaker.record(unavailable=True, reason="down")
    assert breaker.is_open
    clock[0] += 10
    assert await breaker.permit(stop) == 1  # this worker probes
    breaker.record(unavailable=True, reason="down", probe=True)
    clock[0] += 10
    assert await breaker.permit(stop) == 1
    breaker.record(unavailable=False, probe=True)
    assert not breaker.is_open
    assert await breaker.permit(stop) is None


async def test_finalize_survives_killed_database_connections(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    ids = db.insert((f"agg-{i}", "E", {}) for i in range(20))

    killed = {"done": False}

    def script(m: Any) -> None:
        if not killed["done"]:
            killed["done"] = True
            terminate_relay_sessions(pg_dsn)  # while the batch is "at the broker"
        return None

    publisher = InMemoryPublisher(script=script)
    stop = asyncio.Event()
    task = asyncio.create_task(run_relay(settings_for(relay_dsn, names, workers=2, batch_size=5), publisher, stop))
    assert await wait_until_async(lambda: db.statuses() == {"done": 20}, timeout=20)
    stop.set()
    await task
    assert killed["done"]
    assert sorted(set(publisher.delivered_ids())) == ids
    duplicates = len(publisher.delivered_ids()) - len(ids)
    assert duplicates <= 5  # at most the batch in flight when the connections died


# In make test-all: make test keeps killed sessions while the relay runs (here, and
# tests/test_faults.py's crashes) within its time.
@pytest.mark.extended
async def test_sessions_killed_while_the_relay_starts_only_delay_it(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """PostgreSQL drops the relay's sessions again and again while it checks the schema and
    stores its settings (a failover, an operator's pg_terminate_backend): start-up waits
    and tries again instead of dying with a traceback."""
    ids = db.insert((f"agg-{i}", "E", {}) for i in range(10))
    killing = asyncio.Event()

    async def keep_killing() -> None:
        while not killing.is_set():
            await asyncio.to_thread(terminate_relay_sessions, pg_dsn)
            await asyncio.sleep(0.005)

    killer = asyncio.create_task(keep_killing())
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    # A short lease: a claim whose COMMIT reached the database but whose answer was lost
    # with the session holds its rows until the lease runs out.
    settings = settings_for(
        relay_dsn, names, workers=2, lease=timedelta(seconds=2), publish_timeout=timedelta(seconds=1)
    )
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    await asyncio.sleep(1.5)
    killing.set()
    await killer
    assert not task.done() or task.exception() is None, task.exception()
    assert await wait_until_async(lambda: sorted(set(publisher.delivered_ids())) == ids or task.done(), timeout=30)
    assert not task.done(), task.exception()
    stop.set()
    await task
