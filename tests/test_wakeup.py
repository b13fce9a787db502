"""Push wake-ups: an insert wakes an idle relay long before its poll interval."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

from adapters.memory import InMemoryPublisher
from relay.runner import run_relay
from relay.sqlnames import OutboxNames
from tests.conftest import Db
from tests.test_runner import settings_for, wait_until


async def _latency(pg_dsn: str, names: OutboxNames, db: Db, *, notify: bool) -> float:
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    settings = settings_for(pg_dsn, names, workers=2, poll_interval=timedelta(seconds=3), notify=notify)
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    try:
        await asyncio.sleep(0.5)  # both workers have found nothing and gone idle
        started = time.monotonic()
        db.insert([("a", "E", {})])
        await wait_until(lambda: len(publisher.delivered) == 1, timeout=10)
        return time.monotonic() - started
    finally:
        stop.set()
        await task


async def test_insert_wakes_idle_workers(pg_dsn: str, names: OutboxNames, db: Db) -> None:
    assert await _latency(pg_dsn, names, db, notify=True) < 1.0  # the poll interval is 3 s


async def test_without_notify_polling_still_delivers(pg_dsn: str, names: OutboxNames, db: Db) -> None:
    latency = await _latency(pg_dsn, names, db, notify=False)
    assert 0.3 < latency < 5  # found by the 3 s poll, not woken at once
    [(notify,)] = db.conn.execute(f'SELECT notify FROM "{names.schema}".outbox_settings').fetchall()
    assert notify is True  # one process's choice: the producers' trigger and other relays are untouched
