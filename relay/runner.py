"""Runs a process's workers until told to stop, then drains them."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from adapters.base import Publisher
from relay.breaker import CircuitBreaker
from relay.config import RelaySettings
from relay.db import check_schema, open_pool
from relay.store import OutboxStore
from relay.wakeup import listen
from relay.worker import Worker, WorkerStats

log = logging.getLogger("relay.runner")


@dataclass(frozen=True)
class RunResult:
    stats: list[WorkerStats]


def owner_prefix() -> str:
    """``host:pid``: who holds a lease, for people reading the table (fencing uses versions)."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def run_relay(
    settings: RelaySettings,
    publisher: Publisher,
    stop: asyncio.Event,
) -> RunResult:
    """Dispatch with ``settings.workers`` workers until ``stop`` is set.

    On stop, workers finish the batch in hand; whatever is still publishing after
    ``settings.shutdown_grace`` is cancelled, and its rows are handed back without spending an
    attempt. An unexpected error in one worker stops the others and is raised.
    """
    # One connection per worker plus one spare: a worker holds at most one at a time.
    pool = await open_pool(settings.dsn, size=settings.workers + 1)
    try:
        async with pool.connection() as conn:
            await check_schema(conn, settings.names)
        store = OutboxStore(pool, settings.names, settings.ordering)
        replaced = await store.store_settings(notify=settings.notify, commit_order_guard=settings.commit_order_guard)
        if replaced is not None:
            log.warning(
                "ordering map changed from %s to %s; rows inserted from now on are routed by the new map",
                replaced.describe(),
                settings.ordering.describe(),
            )
        await publisher.start()
        try:
            prefix = owner_prefix()
            breaker = CircuitBreaker()  # one per process: an outage pauses every worker
            workers = [
                Worker(store=store, publisher=publisher, owner=f"{prefix}:{i}", config=settings.worker, breaker=breaker)
                for i in range(settings.workers)
            ]
            background = []
            if settings.notify:
                background.append(
                    asyncio.create_task(listen(settings.dsn, settings.names, [w.wakeup for w in workers], stop))
                )
            log.info(
                "relay started: %d workers, broker %s, outbox %s, ordering %s",
                len(workers),
                publisher.name,
                settings.names.qualified,
                settings.ordering.describe(),
            )
            try:
                await _supervise([asyncio.create_task(w.run(stop)) for w in workers], stop, settings.shutdown_grace)
            finally:
                for task in background:
                    task.cancel()
                await asyncio.gather(*background, return_exceptions=True)
            return RunResult(stats=[w.stats for w in workers])
        finally:
            await publisher.close()
    finally:
        await pool.close()


async def _supervise(tasks: Sequence[asyncio.Task[None]], stop: asyncio.Event, grace: timedelta) -> None:
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in done if t is not stopping and t.exception() is not None]
        stop.set()
        if not failed:
            log.info("stopping: finishing the batches in hand (grace %gs)", grace.total_seconds())
        _, pending = await asyncio.wait(tasks, timeout=grace.total_seconds())
        for task in pending:
            task.cancel()
        if pending:
            log.warning("grace period over: abandoned %d in-flight batches", len(pending))
            await asyncio.wait(pending)
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
    finally:
        stopping.cancel()
