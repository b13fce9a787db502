"""Push wake-ups: producers' inserts NOTIFY while every relay is idle, and one dedicated
connection per relay process LISTENs and wakes its idle workers. Polling stays as the
safety net, so a lost notification or a dropped listener only costs latency, never a
message.

Each listening process keeps one row in ``<table>_listeners`` (:class:`Presence`): idle
or working. The producers' insert trigger notifies only while every live row is idle
(migration 0007), so a relay that is busy anyway costs the producers' commits no NOTIFY,
which would serialize them on a database-wide lock.

LISTEN needs a session of its own, which PgBouncer's transaction mode cannot give: turn
wake-ups off there (``relay settings set --no-notify`` for the whole outbox, or
``relay start --no-notify`` for one process, which then writes no row either) and rely on
``--poll-interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import psycopg
from psycopg import sql

from relay.backoff import Backoff
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.session import connect
from relay.errors import DatabaseUnavailable, first_line
from relay.sleep import sleep_unless_stopped

log = logging.getLogger("relay.wakeup")

# How long a process's row in <table>_listeners counts, by the database clock. A running
# process renews it once half is gone (it looks every RENEW_CHECK_S), so its row never
# lapses; a killed process's row lapses within this time, after which it neither draws
# wake-ups (idle) nor holds them back from the other relays (working). Renewing costs one
# single-row write every 3 s per process.
LISTENER_TTL = timedelta(seconds=5)
RENEW_CHECK_S = 1.0
# Rows of killed processes are deleted (by whichever relay renews) about this often.
SWEEP_INTERVAL_S = 60.0
# At shutdown, how long removing the row may take before the relay leaves it to expire.
DROP_TIMEOUT_S = 2.0


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
    on_listening: Callable[[bool], None] | None = None,
) -> None:
    """Set every event in ``events`` whenever a notification arrives, until ``stop``.
    ``on_listening`` hears True once LISTEN is in place and False when the connection is lost."""
    channels = Channels()
    channels.add(names, events, on_listening)
    await channels.listen(dsn, stop, backoff=backoff)


@dataclass
class _Listener:
    events: Sequence[asyncio.Event]
    on_listening: Callable[[bool], None] | None
    listening: bool = False

    def tell(self, on: bool) -> None:
        if self.on_listening is not None and on != self.listening:
            self.on_listening(on)
        self.listening = on


class Channels:
    """The outboxes one LISTEN connection serves (the outboxes of one database in a process
    that serves several, :mod:`relay.fleet`): each outbox's channel wakes its own workers.
    Outboxes come and go while it listens (an outbox's run starts again after a failure)."""

    def __init__(self) -> None:
        self._by_channel: dict[str, list[_Listener]] = {}
        self._added = asyncio.Event()

    def add(
        self, names: OutboxNames, events: Sequence[asyncio.Event], on_listening: Callable[[bool], None] | None = None
    ) -> Callable[[], None]:
        """Wake ``events`` on ``names``' notifications from now on; returns what stops it."""
        listener = _Listener(events, on_listening)
        self._by_channel.setdefault(channel(names), []).append(listener)
        self._added.set()

        def remove() -> None:
            # Its run is ending (its presence row closed already): it hears nothing more.
            listeners = self._by_channel.get(channel(names), [])
            if listener in listeners:
                listeners.remove(listener)

        return remove

    async def listen(self, dsn: str, stop: asyncio.Event, *, backoff: Backoff | None = None) -> None:
        """LISTEN on every channel added (and added later) on one connection, until ``stop``;
        a lost connection is made again (polling covers the gap)."""
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
                    heard: set[str] = set()
                    while not stop.is_set():
                        # Channels added since the last look (all of them on a new connection):
                        # LISTEN, then wake their workers once, since rows may have arrived
                        # while nobody listened.
                        self._added.clear()
                        for name in [c for c in self._by_channel if c not in heard]:
                            await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(name)))
                            heard.add(name)
                        for listeners in self._by_channel.values():
                            for listener in listeners:
                                if not listener.listening:
                                    listener.tell(True)
                                    for event in listener.events:
                                        event.set()
                        if failures:
                            log.info("wake-up listener reconnected")
                        failures = 0
                        # A timeout lets us notice `stop` and new channels; a batch of
                        # notifications wakes each outbox's workers once.
                        woken: set[str] = set()
                        async for note in conn.notifies(timeout=1.0, stop_after=1):
                            woken.add(note.channel)
                        for name in woken:
                            for listener in self._by_channel.get(name, ()):
                                for event in listener.events:
                                    event.set()
            except psycopg.OperationalError as exc:
                for listeners in self._by_channel.values():
                    for listener in listeners:
                        listener.tell(False)
                failures += 1
                log.warning("wake-up listener lost its connection, polling meanwhile: %s", str(exc).strip())
                await sleep_unless_stopped(stop, backoff.delay(failures).total_seconds())


class Presence:
    """This process's row in ``<table>_listeners``, which the producers' insert trigger reads
    to decide whether to NOTIFY (migration 0007).

    The process is *idle* while every one of its workers found nothing and waits, and
    *working* from the moment one of them claims rows. Producers notify only while every
    live row is idle: a working relay claims new rows at its next claim without a wake-up.
    A process writes a row only while its LISTEN is in place (nobody else would hear the
    wake-up) and removes it when it stops; a killed one's row expires (``LISTENER_TTL``).

    Going idle has a race, and the worker that writes the idle row closes it: a row that
    committed after the workers' last empty claims, but whose INSERT ran before the idle row
    committed, sent no wake-up. So that worker claims once more before it sleeps (``idle``
    returns True); a row whose INSERT runs after the idle row committed sends a wake-up.

    All writes go through one lock, each writing the state the workers are in when it runs,
    so a late write can never leave a stale state behind.
    """

    def __init__(
        self,
        store: OutboxStore,
        owner: str,
        workers: Sequence[str],
        events: Sequence[asyncio.Event],
        *,
        ttl: timedelta = LISTENER_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        :param owner: the process's name in the table (``host:pid``)
        :param workers: the owner name of every worker of the process
        :param events: the workers' wake-up events, set to make them claim again
        """
        self._store = store
        self.owner = owner
        self._workers = frozenset(workers)
        self._events = tuple(events)
        self._ttl = ttl
        self._clock = clock
        self._lock = asyncio.Lock()
        self._listening = False
        self._closed = False
        self._asleep: set[str] = set()
        self._working: set[str] = set()
        self._written: bool | None = None  # the row as last written: idle, working, or none
        self._sent_at = float("-inf")  # when that write was sent (its expiry counts from after)
        self._unsure = False  # the last write failed: the row may be in any state
        self._tasks: set[asyncio.Task[None]] = set()
        self._last_sweep = float("-inf")

    @property
    def state(self) -> str:
        """``idle``, ``working`` or ``none``, as last written (for logs and tests)."""
        return {True: "idle", False: "working", None: "none"}[self._written]

    def set_listening(self, on: bool) -> None:
        """The listener's LISTEN is in place (True) or its connection was lost (False)."""
        self._listening = on
        if not on:
            self._sync_soon()  # nobody hears a wake-up now: remove the row

    async def idle(self, worker: str) -> bool:
        """``worker`` found nothing to do and is about to sleep. True when it must claim once
        more first: its process has just told the producers it is idle."""
        self._asleep.add(worker)
        self._working.discard(worker)
        if not self._listening or self._asleep < self._workers:
            return False
        async with self._lock:
            fresh = await self._sync()
        if fresh:
            self._asleep.discard(worker)  # awake again, for its last look
        return fresh

    def awake(self, worker: str) -> None:
        """``worker`` woke (a wake-up, or its poll interval ran out) and claims again."""
        self._asleep.discard(worker)

    def working(self, worker: str, *, saturated: bool) -> None:
        """``worker`` claimed rows: the process is working, so the producers need not notify.
        ``saturated``: its batch came back full, so more rows wait; its sleeping siblings are
        woken for them (the producers no longer do that while this process works)."""
        self._working.add(worker)
        if self._listening and (self._written is not False or self._unsure):
            self._sync_soon()
        if saturated:
            for event in self._events:
                event.set()

    async def keep_alive(self, stop: asyncio.Event) -> None:
        """Renew the row before it expires, until ``stop``; now and then delete the rows of
        processes that were killed."""
        while not stop.is_set():
            await sleep_unless_stopped(stop, RENEW_CHECK_S)
            if stop.is_set():
                return
            async with self._lock:  # one pool connection at most for this row's writes
                lapsed = await self._sync()
                if self._written is not None and self._clock() - self._last_sweep >= SWEEP_INTERVAL_S:
                    self._last_sweep = self._clock()
                    with contextlib.suppress(psycopg.Error):
                        await self._store.sweep_listeners()
            if lapsed:
                # The idle row had expired or was unknown (a stall, a failed write): rows
                # inserted meanwhile sent no wake-up, so the workers look again.
                for event in self._events:
                    event.set()

    async def close(self) -> None:
        """Remove the row (the process stops); if the database does not answer quickly, the
        row is left to expire."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DROP_TIMEOUT_S), self._lock:
                await self._sync()

    # ---- writing the row

    def _desired(self) -> bool | None:
        if self._closed or not self._listening:
            return None
        if self._asleep >= self._workers:
            return True
        if self._working:
            return False
        return self._written  # awake, nothing found yet: no change

    def _sync_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._locked_sync())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _locked_sync(self) -> None:
        async with self._lock:
            await self._sync()

    async def _sync(self) -> bool:
        """Bring the row in line with the workers (the caller holds the lock). True when it
        has just become idle, not having been idle and live: the caller must look for rows
        once more, since inserts until this moment sent no wake-up."""
        want = self._desired()
        now = self._clock()
        live = not self._unsure and self._written is not None and now < self._sent_at + self._ttl.total_seconds()
        try:
            if want is None:
                if self._written is not None or self._unsure:
                    await self._store.drop_listener(self.owner)
                    self._written = None
                    self._recovered()
                return False
            if want == self._written and live and now < self._sent_at + self._ttl.total_seconds() / 2:
                return False
            fresh = want and not (self._written is True and live)
            await self._store.set_listener(self.owner, idle=want, ttl=self._ttl)
            self._written, self._sent_at = want, now
            self._recovered()
            return fresh
        except asyncio.CancelledError:
            self._unsure = True  # the write may or may not have landed
            raise
        except psycopg.Error as exc:
            if not self._unsure:
                log.warning(
                    "cannot record this relay as %s in %s_listeners, wake-ups may be missed or sent"
                    " needlessly until it can: %s",
                    "idle" if want else "working" if want is False else "gone",
                    self._store.names.qualified,
                    first_line(exc),
                )
            self._unsure = True
            return False

    def _recovered(self) -> None:
        if self._unsure:
            self._unsure = False
            log.info("recorded this relay as %s in %s_listeners again", self.state, self._store.names.qualified)
