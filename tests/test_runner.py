"""The process-level runner: several workers over one pool, and shutdown."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from adapters.memory import STALL, InMemoryPublisher
from relay.config import CORE_OPTIONS, START_OPTIONS, RelaySettings, resolve
from relay.runner import run_relay
from relay.sqlnames import OutboxNames
from tests.conftest import Db


def settings_for(pg_dsn: str, names: OutboxNames, **over: object) -> RelaySettings:
    values = resolve((*CORE_OPTIONS, *START_OPTIONS), {}, {}, {})
    values.update(
        dsn=pg_dsn, schema=names.schema, table=names.table, broker="log", poll_interval=timedelta(milliseconds=50)
    )
    values.update(over)
    return RelaySettings.from_values(values)


async def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_workers_share_the_work(pg_dsn: str, names: OutboxNames, db: Db) -> None:
    ids = db.insert((f"agg-{i % 40}", "E", {"i": i}) for i in range(400))
    publisher = InMemoryPublisher(delay=0.005)
    stop = asyncio.Event()
    settings = settings_for(pg_dsn, names, workers=4, batch_size=20, ordering_default="unordered")
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    await wait_until(lambda: db.statuses() == {"done": 400})
    stop.set()
    result = await task
    assert sorted(publisher.delivered_ids()) == ids
    assert len(publisher.delivered_ids()) == 400
    assert sum(1 for s in result.stats if s.published) >= 2
    assert publisher.started and publisher.closed


async def test_shutdown_hands_unpublished_rows_back_without_spending_an_attempt(
    pg_dsn: str, names: OutboxNames, db: Db
) -> None:
    db.insert((f"agg-{i}", "E", {}) for i in range(5))
    publisher = InMemoryPublisher(script=lambda m: STALL)  # a broker that never answers
    stop = asyncio.Event()
    settings = settings_for(pg_dsn, names, workers=2, shutdown_grace=timedelta(milliseconds=300))
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    await wait_until(lambda: db.statuses() == {"processing": 5})
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert time.monotonic() - started < 2  # the grace period, not the 20 s publish timeout
    rows = db.rows()
    assert [(r["status"], r["attempts"], r["lease_until"]) for r in rows] == [("pending", 0, None)] * 5
    assert all(r["last_error"] == "released unpublished at shutdown" for r in rows)
    assert all(r["available_at"] <= r["created_at"] + timedelta(seconds=30) for r in rows)
