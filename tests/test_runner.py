"""The process-level runner: several workers over one pool, and shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta

import pytest

from relay.db.names import OutboxNames
from relay.runner import run_relay
from relay.services import Every
from relay.testing import STALL, InMemoryPublisher
from tests.conftest import Db
from tests.helpers import settings_for
from tests.relay_process import wait_until_async


async def test_workers_share_the_work(pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db) -> None:
    ids = db.insert((f"agg-{i % 40}", "E", {"i": i}) for i in range(400))
    publisher = InMemoryPublisher(delay=0.005)
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=4, batch_size=20, ordering_default="unordered")
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    assert await wait_until_async(lambda: db.statuses() == {"done": 400})
    stop.set()
    result = await task
    assert sorted(publisher.delivered_ids()) == ids
    assert len(publisher.delivered_ids()) == 400
    assert sum(1 for s in result.stats if s.published) >= 2
    assert publisher.started and publisher.closed


async def test_shutdown_hands_unpublished_rows_back_without_spending_an_attempt(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    db.insert((f"agg-{i}", "E", {}) for i in range(5))
    publisher = InMemoryPublisher(script=lambda m: STALL)  # a broker that never answers
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=2, shutdown_grace=timedelta(milliseconds=300))
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    assert await wait_until_async(lambda: db.statuses() == {"processing": 5})
    started = time.monotonic()
    stop.set()
    await asyncio.wait_for(task, timeout=5)
    assert time.monotonic() - started < 2  # the grace period, not the 20 s publish timeout
    rows = db.rows()
    assert [(r["status"], r["attempts"], r["lease_until"]) for r in rows] == [("pending", 0, None)] * 5
    assert all(r["last_error"] == "released unpublished at shutdown" for r in rows)
    assert all(r["available_at"] <= r["created_at"] + timedelta(seconds=30) for r in rows)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(fetch)


async def test_start_serves_metrics_and_health_and_prunes_on_schedule(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    from relay.runner import Operations

    db.insert((f"agg-{i}", "OrderPlaced", {}) for i in range(30))
    port = _free_port()
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    operate = Operations(
        metrics_port=port,
        metrics_host="127.0.0.1",
        prune_older_than=timedelta(0),
        prune_interval=timedelta(milliseconds=300),
    )
    task = asyncio.create_task(run_relay(settings_for(relay_dsn, names, workers=2), publisher, stop, operate=operate))
    try:
        assert await wait_until_async(lambda: len(publisher.delivered) == 30)
        # The counter moves when the finalize is written, a moment after the broker's ack.
        published = 'outbox_relay_messages_total{event_type="OrderPlaced",outcome="published"} 30.0'
        deadline = time.monotonic() + 10
        while True:
            status, body = await _get(f"http://127.0.0.1:{port}/metrics")
            assert status == 200
            if published in body or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert published in body
        assert "outbox_relay_claim_seconds_bucket" in body
        assert 'outbox_relay_circuit_open{destination="all"} 0.0' in body
        assert (await _get(f"http://127.0.0.1:{port}/healthz"))[0] == 200
        assert (await _get(f"http://127.0.0.1:{port}/readyz"))[0] == 200
        # The scheduled prune (older than 0 s, every 0.3 s) removes the finished rows.
        assert await wait_until_async(lambda: db.rows() == [], timeout=10)
    finally:
        stop.set()
        await task


async def test_of_two_relays_with_a_scheduled_prune_one_prunes(
    relay_dsn: str, names: OutboxNames, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    """The scheduled prune is a duty for one relay of the outbox: both are configured with
    it, one is elected and prunes, the other stands by."""
    from relay.runner import Operations

    db.insert((f"agg-{i}", "OrderPlaced", {}) for i in range(10))
    caplog.set_level(logging.INFO, logger="relay.services")
    operate = Operations(prune_older_than=timedelta(0), prune_interval=timedelta(milliseconds=200))
    stop = asyncio.Event()
    runs = [
        asyncio.create_task(
            run_relay(settings_for(relay_dsn, names, workers=1), InMemoryPublisher(), stop, operate=operate)
        )
        for _ in range(2)
    ]
    try:
        assert await wait_until_async(lambda: db.rows() == [], timeout=15)
        messages = [r.getMessage() for r in caplog.records]
        assert sum("leads for" in m for m in messages) == 1, messages
        assert sum("stands by" in m for m in messages) == 1, messages
    finally:
        stop.set()
        await asyncio.gather(*runs)


async def test_a_scheduled_job_whose_error_has_no_message_is_logged_and_runs_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``str(exc)`` of ``OSError()`` is empty: the warning must still be written and the
    job scheduled again, not the scheduler die inside its own handler."""
    stop = asyncio.Event()
    calls = 0

    async def job() -> None:
        nonlocal calls
        calls += 1
        if calls >= 3:
            stop.set()
        raise OSError()

    caplog.set_level(logging.WARNING, logger="relay.services")
    await asyncio.wait_for(Every("scheduled prune", timedelta(milliseconds=10), job).run(stop), timeout=5)
    assert calls == 3
    assert caplog.text.count("scheduled prune failed, trying again in 0s: OSError") == 3
