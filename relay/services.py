"""The running relay's background duties as small objects a supervisor
(:mod:`relay.supervisor`) starts, watches and stops beside the workers.

A duty has a name and three steps: ``start`` (before any worker claims: what must refuse
the start, such as a metrics port that cannot be bound), ``run(stop)`` (until ``stop`` is
set) and ``close`` (after every worker has ended). :class:`Duty` makes one of plain
functions, :class:`Every` of a job repeated on an interval, and :class:`Elected` one that
only a single relay of an outbox runs at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import psycopg

from relay.db import leadership
from relay.db.names import OutboxNames
from relay.db.session import TRANSIENT_DB_ERRORS, connect
from relay.errors import DatabaseUnavailable, first_line
from relay.sleep import sleep_unless_stopped

log = logging.getLogger("relay.services")


class Service(Protocol):
    """One background duty of a running relay (see the module docstring)."""

    @property
    def name(self) -> str: ...

    async def start(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    async def close(self) -> None: ...


async def _nothing() -> None:
    return None


@dataclass
class Duty:
    """A duty made of functions: ``body(stop)`` runs it; ``opening`` and ``closing``, if
    given, are its start and close."""

    name: str
    body: Callable[[asyncio.Event], Awaitable[None]]
    opening: Callable[[], Awaitable[None]] = _nothing
    closing: Callable[[], Awaitable[None]] = _nothing

    async def start(self) -> None:
        await self.opening()

    async def run(self, stop: asyncio.Event) -> None:
        await self.body(stop)

    async def close(self) -> None:
        await self.closing()


# What a repeated job may fail with and still be tried again at its next turn: the
# database or the network went away for a moment.
_PASSING = (psycopg.Error, DatabaseUnavailable, OSError)


@dataclass
class Every:
    """``job`` now, then every ``interval`` until stopped; a failure of the database or
    the network is logged and the job tried again at its next turn."""

    name: str
    interval: timedelta
    job: Callable[[], Awaitable[None]]

    async def start(self) -> None:
        return None

    async def run(self, stop: asyncio.Event) -> None:
        seconds = self.interval.total_seconds()
        while not stop.is_set():
            try:
                await self.job()
            except _PASSING as exc:
                # first_line: an exception with an empty message has no first line to index.
                log.warning("%s failed, trying again in %.0fs: %s", self.name, seconds, first_line(exc))
            await sleep_unless_stopped(stop, seconds)

    async def close(self) -> None:
        return None


# How often a relay that is not the leader asks again, and how often the leader makes sure
# its lock's connection is still there (a connection lost is a lock released: another
# relay may lead from then on, so this one stops its duty).
ELECTION_RETRY = timedelta(seconds=15)
LEADER_CHECK = timedelta(seconds=5)


# A relay that cannot reach the database to ask who leads asks again later.
_UNREACHABLE: tuple[type[Exception], ...] = (*TRANSIENT_DB_ERRORS, DatabaseUnavailable)


@dataclass
class Elected:
    """``inner`` run by one relay of the outbox at a time: the one holding the duty's
    advisory lock (:mod:`relay.db.leadership`), on a connection of its own for as long as
    it leads. The others wait and ask again every :data:`ELECTION_RETRY`; when the leader
    stops or its connection is lost, one of them takes over."""

    inner: Service
    dsn: str
    names: OutboxNames
    duty: str
    retry: timedelta = ELECTION_RETRY
    check: timedelta = LEADER_CHECK

    @property
    def name(self) -> str:
        return self.inner.name

    async def start(self) -> None:
        await self.inner.start()

    async def run(self, stop: asyncio.Event) -> None:
        announced = False
        while not stop.is_set():
            try:
                conn = await connect(self.dsn)
            except _UNREACHABLE as exc:
                log.warning("%s: cannot ask who leads, trying again: %s", self.name, first_line(exc))
                await sleep_unless_stopped(stop, self.retry.total_seconds())
                continue
            async with conn:
                try:
                    leading = await leadership.take(conn, self.names, self.duty)
                except TRANSIENT_DB_ERRORS as exc:
                    log.warning("%s: cannot ask who leads, trying again: %s", self.name, first_line(exc))
                    leading = False
                if not leading:
                    if not announced:
                        log.info("%s: another relay of %s runs it; this one stands by", self.name, self.names.qualified)
                        announced = True
                    await sleep_unless_stopped(stop, self.retry.total_seconds())
                    continue
                log.info("%s: this relay leads for %s and runs it", self.name, self.names.qualified)
                announced = False
                await self._lead(conn, stop)
            # Lost the lead (or stopping): stand back for a turn, so that a relay whose
            # connection is sound takes over rather than this one again at once.
            await sleep_unless_stopped(stop, self.retry.total_seconds())

    async def _lead(self, conn: psycopg.AsyncConnection[object], stop: asyncio.Event) -> None:
        """Run the duty while the lock's connection lives; end it when that is lost."""
        duty = asyncio.create_task(self.inner.run(stop), name=f"relay duty {self.name}")
        try:
            while not duty.done():
                await asyncio.wait([duty], timeout=self.check.total_seconds())
                if duty.done() or stop.is_set():
                    break
                if not await leadership.still_held(conn):
                    log.warning("%s: the leader's connection was lost; another relay may lead now", self.name)
                    break
        finally:
            if not duty.done():
                duty.cancel()
            await asyncio.gather(duty, return_exceptions=True)
        failure = None if duty.cancelled() else duty.exception()
        if failure is not None:
            raise failure  # the supervisor logs it and starts the duty again after a pause

    async def close(self) -> None:
        await self.inner.close()
