"""Push wake-ups: producers' inserts NOTIFY, and one dedicated connection per relay
process LISTENs and wakes its idle workers. Polling stays as the safety net, so a lost
notification or a dropped listener only costs latency, never a message.

LISTEN needs a session of its own, which PgBouncer's transaction mode cannot give: turn
wake-ups off there (``relay settings set --no-notify`` for the whole outbox, or
``relay start --no-notify`` for one process) and rely on ``--poll-interval``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta

import psycopg
from psycopg import sql

from relay.backoff import Backoff
from relay.db import connect
from relay.errors import DatabaseUnavailable
from relay.sleep import sleep_unless_stopped
from relay.sqlnames import OutboxNames

log = logging.getLogger("relay.wakeup")


def channel(names: OutboxNames) -> str:
    """The channel the insert trigger notifies: ``schema.table`` (see migration 0002)."""
    return f"{names.schema}.{names.table}"


async def listen(
    dsn: str,
    names: OutboxNames,
    events: Sequence[asyncio.Event],
    stop: asyncio.Event,
    *,
    backoff: Backoff | None = None,
) -> None:
    """Set every event in ``events`` whenever a notification arrives, until ``stop``."""
    backoff = backoff or Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=30))
    failures = 0
    while not stop.is_set():
        try:
            conn = await connect(dsn)
        except DatabaseUnavailable as exc:
            failures += 1
            log.warning("wake-up listener cannot connect, polling meanwhile: %s", exc)
            await sleep_unless_stopped(stop, backoff.delay(failures).total_seconds())
            continue
        try:
            async with conn:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(names))))
                if failures:
                    log.info("wake-up listener reconnected")
                failures = 0
                # Wake everyone once: rows may have arrived while we were not listening.
                for event in events:
                    event.set()
                while not stop.is_set():
                    # A timeout lets us notice `stop`; each batch of notifications wakes once.
                    async for _ in conn.notifies(timeout=1.0, stop_after=1):
                        for event in events:
                            event.set()
        except psycopg.OperationalError as exc:
            failures += 1
            log.warning("wake-up listener lost its connection, polling meanwhile: %s", str(exc).strip())
            await sleep_unless_stopped(stop, backoff.delay(failures).total_seconds())
