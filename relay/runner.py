"""Runs a process's workers until told to stop, then drains them; and beside them the
wake-up listener, the metrics endpoint, the gauge refresher and the scheduled prune.

A run owns every task it starts: whether it ends because it was told to stop, because a
worker failed, or because the task running it was cancelled (an application shutting
down the relay it embeds), it returns or raises only once each of them has ended, the
rows in flight have been written or handed back, and then the broker connection and the
pool are closed, in that order. So two runs in one process (two outboxes) never touch
each other's tasks, and a run leaves nothing behind in the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg_pool import AsyncConnectionPool

from relay.breaker import CircuitBreaker
from relay.claimcheck import ClaimCheckStore, StoredPayloads
from relay.config import RelaySettings
from relay.contract import Publisher, ReportsUnroutable, WatchesDestinations
from relay.db.dispatch import OutboxStore
from relay.db.partitions import is_partitioned, keep_ahead
from relay.db.session import TRANSIENT_DB_ERRORS, check_schema, connect, open_pool
from relay.db.settings import SharedSettings, read_settings
from relay.db.text import SQL_ASCII, server_encoding
from relay.errors import ConfigError, first_line
from relay.member import Member
from relay.readiness import Destinations, not_ready
from relay.services import Duty, Elected, Every, Service
from relay.shared_settings import Given, disagreements
from relay.sleep import sleep_unless_stopped
from relay.supervisor import Supervisor
from relay.tracing import Tracing
from relay.wakeup import Presence, listen
from relay.worker import Shared, Worker, WorkerStats

if TYPE_CHECKING:
    from relay.metrics import RelayMetrics  # prometheus-client is imported only when asked for

log = logging.getLogger("relay.runner")

T = TypeVar("T")

# The queue-depth and oldest-age gauges are read from the table this often: cheap queries
# (partial indexes only), and Prometheus scrapes every 15 to 60 s anyway.
GAUGE_REFRESH_S = 15.0
# How often the elected relay of a partitioned outbox makes sure its partitions ahead exist.
PARTITIONS_AHEAD_CHECK = timedelta(minutes=1)


@dataclass(frozen=True)
class RunResult:
    stats: list[WorkerStats]


@dataclass(frozen=True)
class Operations:
    """What `relay start` runs beside the workers; all off by default."""

    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    prune_older_than: timedelta | None = None
    prune_interval: timedelta = timedelta(hours=1)
    prune_heads_idle_for: timedelta | None = None

    @classmethod
    def from_values(cls, v: Mapping[str, Any]) -> Operations:
        # Only a missing value means the default: `or` would read an interval of 0s (falsy)
        # as "1 hour". The option's bounds refuse 0s before it gets here.
        interval = v.get("prune_interval")
        heads = v.get("prune_heads_idle_for")
        if heads is not None and v.get("prune_older_than") is None:
            raise ConfigError("--prune-heads-idle-for runs with the scheduled prune: give --prune-older-than too")
        return cls(
            metrics_port=v.get("metrics_port"),
            metrics_host=v.get("metrics_host") or "0.0.0.0",
            prune_older_than=v.get("prune_older_than"),
            prune_interval=timedelta(hours=1) if interval is None else interval,
            prune_heads_idle_for=heads,
        )


def owner_prefix() -> str:
    """``host:pid``: who holds a lease, for people reading the table (fencing uses versions)."""
    return f"{socket.gethostname()}:{os.getpid()}"


async def run_relay(
    settings: RelaySettings,
    publisher: Publisher,
    stop: asyncio.Event,
    *,
    operate: Operations | None = None,
    given: Sequence[Given] = (),
    tracing: Tracing | None = None,
    ready: asyncio.Event | None = None,
    member: Member | None = None,
) -> RunResult:
    """Dispatch with ``settings.workers`` workers until ``stop`` is set.

    The shared settings (ordering map, wake-ups) are read from the database, never written:
    ``given`` are the ones this process's configuration named explicitly, and each that
    disagrees with the stored value is logged as a warning. ``settings.notify`` off means
    this process does not LISTEN; it cannot turn off the producers' NOTIFY.

    On stop, workers finish the batch in hand; whatever is still publishing after
    ``settings.shutdown_grace`` is cancelled, and its rows are handed back without
    spending an attempt. An unexpected error in one worker stops the others and is raised.

    ``tracing`` (relay.tracing) is the workers' spans; the caller shuts it down.

    ``ready`` is set once the relay is connected to PostgreSQL and the broker, has checked
    the schema and the destinations, and its workers start: what an embedding application
    waits for (relay.embed). Whatever stops the start-up before that is raised.

    ``stop`` is honoured at every step of the start-up too (connecting to the database,
    checking the schema, connecting to the broker, checking the destinations): whatever
    that step is waiting for is abandoned, and the run returns with no stats.

    ``member``: the outbox is one of several this process serves (relay.fleet); the run
    borrows the member's pool, listener and metrics and the caller's started publisher,
    closes none of them, and serves no endpoint of its own.

    Cancelling the task that runs this stops the relay at once (:func:`_supervise`): every
    task it started is cancelled and waited for, the rows in flight are handed back
    without spending an attempt, the broker connection is closed once no worker can
    publish any more, then the pool; then the CancelledError goes on.
    """
    operate = operate or Operations()
    if member is not None:
        return await _run_member(settings, publisher, stop, operate, given, tracing, ready, member)
    # This run's pool tasks inherit the flag (they are started in this context): see
    # _QuietAbandonedPool.
    quiet = _PoolQuiet()
    _POOL_QUIET.set(quiet)
    # One connection per worker plus one spare: a worker holds at most one at a time.
    pool = await unless_stopped(
        stop,
        "connecting to PostgreSQL",
        open_pool(settings.dsn, size=settings.workers + 1, limits=settings.session),
        discard=lambda p: _close_pool(p, quiet, abandoned=True),
    )
    if pool is None:
        return RunResult(stats=[])
    running = False
    try:
        for warning in settings.warnings:
            log.warning("%s", warning)
        prepared = await unless_stopped(stop, "checking the outbox", _prepare(settings, pool, stop))
        if prepared is None:  # stopped while the database was still refusing us
            return RunResult(stats=[])
        stored, partitioned = prepared
        for line in disagreements(stored, given, settings.names):
            log.warning("%s", line)
        try:
            if await unless_stopped(stop, "connecting to the broker", started(publisher)) is None:
                return RunResult(stats=[])
            destinations = Destinations(publisher, _claim_check(settings))
            if await unless_stopped(stop, "checking the destinations", destinations.check()) is None:
                return RunResult(stats=[])
            store = _store(pool, settings)
            running = True
            return await _run(
                settings, operate, publisher, store, (stored, partitioned), pool, stop, tracing, destinations, ready
            )
        finally:
            # Only now: every worker has ended (_run waits for them whatever ends it), so
            # no publish is in flight that closing the connection would cut short.
            await publisher.close()
    finally:
        await _close_pool(pool, quiet, abandoned=stop.is_set() and not running)


async def _run_member(
    settings: RelaySettings,
    publisher: Publisher,
    stop: asyncio.Event,
    operate: Operations,
    given: Sequence[Given],
    tracing: Tracing | None,
    ready: asyncio.Event | None,
    member: Member,
) -> RunResult:
    """run_relay's start-up for one outbox of several: what the process lends is open
    already, and stays open when the run ends."""
    pool = member.pool
    for warning in settings.warnings:
        log.warning("%s", warning)
    prepared = await unless_stopped(stop, "checking the outbox", _prepare(settings, pool, stop, member))
    if prepared is None:
        return RunResult(stats=[])
    stored, partitioned = prepared
    for line in disagreements(stored, given, settings.names):
        log.warning("%s", line)
    destinations = Destinations(publisher, _claim_check(settings))
    if await unless_stopped(stop, "checking the destinations", destinations.check()) is None:
        return RunResult(stats=[])
    store = _store(pool, settings)
    return await _run(
        settings, operate, publisher, store, (stored, partitioned), pool, stop, tracing, destinations, ready, member
    )


def _claim_check(settings: RelaySettings) -> ClaimCheckStore | None:
    return None if settings.claim_check is None else ClaimCheckStore(settings.claim_check)


def _store(pool: AsyncConnectionPool[Any], settings: RelaySettings) -> OutboxStore:
    """The outbox's store; with the claim-check on, payloads it will store are spooled to a
    file rather than read into memory."""
    cc = settings.claim_check
    return OutboxStore(pool, settings.names, settings.session, spools=None if cc is None else cc.stores)


async def started(publisher: Publisher) -> bool:
    await publisher.start()
    return True


# A start-up step cut short by a stop gets this long to end before the relay exits anyway.
ABANDON_WAIT_S = 2.0
# Closing the pool waits this long at most for connection attempts still in progress
# after a stop during start-up (each may wait out libpq's connect_timeout, 5 s): the
# process is exiting, and the attempts end with it.
STOPPED_POOL_CLOSE_S = 0.5


class _PoolQuiet:
    """Whether this run's pool was abandoned during the start-up (see below)."""

    abandoned = False


_POOL_QUIET: ContextVar[_PoolQuiet | None] = ContextVar("relay_pool_quiet", default=None)


class _QuietAbandonedPool(logging.Filter):
    """Drops psycopg_pool's warnings about the connection attempts of a pool whose start-up
    was stopped ("couldn't stop task", "error connecting"): the relay has said it stopped,
    and the attempts end with the process. Only that run's: its pool's tasks were started
    in its context, which holds its :class:`_PoolQuiet`, so another relay of the same
    process (another outbox) keeps every warning of its own pool."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = _POOL_QUIET.get()
        return quiet is None or not quiet.abandoned or record.levelno > logging.WARNING


logging.getLogger("psycopg.pool").addFilter(_QuietAbandonedPool())


async def _close_pool(pool: AsyncConnectionPool[Any], quiet: _PoolQuiet, *, abandoned: bool) -> None:
    """Close ``pool``; ``abandoned``: the start-up was stopped, perhaps with connection
    attempts still waiting for a server that does not answer."""
    if abandoned:
        quiet.abandoned = True
        await pool.close(timeout=STOPPED_POOL_CLOSE_S)
    else:
        await pool.close()


async def unless_stopped(
    stop: asyncio.Event,
    step: str,
    work: Coroutine[Any, Any, T],
    *,
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T | None:
    """``work``'s result, or None once ``stop`` is set first: the work is then cancelled
    (a connection attempt, a wait for the pool, a broker that never answers: start-up
    steps hold nothing that a cancel could lose) and the stop logged with the step.

    Cancelled itself (run_relay's task was), it cancels the work, waits for it as long as
    after a stop, and raises; a result the work had made all the same is handed to
    ``discard`` (a pool to close), so nothing the step opened outlives the run."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    except BaseException as exc:
        if isinstance(exc, asyncio.CancelledError):
            await _abandon_step(task, discard)
        else:  # the process is going (SystemExit, KeyboardInterrupt): no time to wait
            task.cancel()
        raise
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    await _abandon_step(task, None)
    log.info("stopped while %s; nothing was claimed", step)
    return None


async def _abandon_step(task: asyncio.Future[T], discard: Callable[[T], Awaitable[None]] | None) -> None:
    task.cancel()
    # Bounded: a client library that took the cancel for a failed attempt and went on
    # would otherwise hold the exit (aio-pika's robust connection did; its adapter closes it).
    await asyncio.wait([task], timeout=ABANDON_WAIT_S)
    if not task.done() or task.cancelled():
        return
    # Retrieved even when it failed: what it raised on the way out is moot now, but
    # asyncio would warn that it was never retrieved.
    if task.exception() is None and discard is not None:
        await discard(task.result())  # it had finished before the cancel reached it


async def _prepare(
    settings: RelaySettings, pool: AsyncConnectionPool[Any], stop: asyncio.Event, member: Member | None = None
) -> tuple[SharedSettings, bool] | None:
    """Check the schema, read the shared settings and whether the outbox is partitioned. A
    database that answered the first connection but then drops sessions (a failover,
    pg_terminate_backend) is waited for, with the workers' backoff, until it lets us through
    or we are told to stop."""
    failures = 0
    while True:
        try:
            async with pool.connection() as conn:
                await check_schema(conn, settings.names)
                encoding = server_encoding(conn)
                stored = await read_settings(conn, settings.names)
                partitioned = await is_partitioned(conn, settings.names)
            break
        except TRANSIENT_DB_ERRORS as exc:  # PoolTimeout is one too
            failures += 1
            delay = settings.worker.db_backoff.delay(failures).total_seconds()
            log.warning("database error while starting, retrying in %.1fs: %s", delay, first_line(exc))
            if member is not None:
                member.hold(f"database: {first_line(exc)}")
            await sleep_unless_stopped(stop, delay)
            if stop.is_set():
                return None
    if encoding == SQL_ASCII:
        log.warning(
            "the database's encoding is SQL_ASCII, which stores text unchecked: the relay reads it as UTF-8,"
            " and a row whose text is not valid UTF-8 goes to dead alone"
        )
    return stored, partitioned


async def _run(
    settings: RelaySettings,
    operate: Operations,
    publisher: Publisher,
    store: OutboxStore,
    prepared: tuple[SharedSettings, bool],
    pool: AsyncConnectionPool[Any],
    stop: asyncio.Event,
    tracing: Tracing | None,
    destinations: Destinations,
    ready: asyncio.Event | None,
    member: Member | None = None,
) -> RunResult:
    stored, partitioned = prepared
    metrics = None
    if member is not None:
        metrics = member.metrics
    elif operate.metrics_port is not None:
        from relay.metrics import RelayMetrics  # prometheus-client only when asked for

        metrics = RelayMetrics()
    if metrics is not None and isinstance(publisher, ReportsUnroutable):
        held = publisher
        metrics.watch_unroutable(lambda: len(held.unroutable()))

    # Routes: one breaker each, for the metrics and for readiness.
    def on_destination(name: str, is_open: bool) -> None:
        destinations.destination_changed(name, is_open)
        if metrics is not None:
            metrics.set_destination_open(name, is_open)

    if member is not None:  # the process watches the publisher it may share, and tells each outbox
        member.on_destination.append(on_destination)
    elif isinstance(publisher, WatchesDestinations):
        publisher.watch_destinations(on_destination)
    prefix = owner_prefix()
    owners = [f"{prefix}:{i}" for i in range(settings.workers)]
    events = [asyncio.Event() for _ in owners]
    # Listening is pointless while the producers' trigger sends nothing (stored notify off),
    # and this process may be told not to (behind a transaction-mode pooler). A process
    # that does not listen writes no row in <table>_listeners: nobody would hear its wake-ups.
    listening = stored.notify and settings.notify
    shared = Shared(
        breaker=CircuitBreaker(on_change=metrics.set_circuit_open if metrics else None),
        presence=Presence(store, prefix, owners, events) if listening else None,
        metrics=metrics,
        tracing=tracing,
        arrivals=None if member is None else member.arrivals,
        # Its buckets were checked with the destinations: one missing is held, not refused
        # (messages over the threshold wait, no attempt spent; each publish tries again).
        claim_check=destinations.claim_check,
    )
    workers = [
        Worker(store=store, publisher=publisher, owner=owner, config=settings.worker, wakeup=event, shared=shared)
        for owner, event in zip(owners, events, strict=True)
    ]
    services = _services(settings, operate, pool, destinations, shared, events, metrics, member, partitioned)
    log.info(
        "relay started: %d workers, broker %s, outbox %s, ordering %s (stored), wake-ups %s%s",
        len(workers),
        publisher.name,
        settings.names.qualified,
        stored.ordering.describe(),
        "on" if listening else f"off (polling every {settings.worker.poll_interval.total_seconds():g}s)",
        ", tracing on" if tracing is not None and tracing.enabled else "",
    )
    if member is not None:
        from relay.httpd import all_ready, pool_check

        member.delivering(all_ready(pool_check(pool, settings.names), _broker_check(shared, destinations)))
    try:
        await Supervisor(services).run(
            [w.run(stop) for w in workers],
            stop,
            settings.shutdown_grace,
            ready=ready,
            names=[f"relay worker {w.owner} {settings.names.qualified}" for w in workers],
        )
    finally:
        if member is not None:
            member.hold("stopped")
            with contextlib.suppress(ValueError):
                member.on_destination.remove(on_destination)
    return RunResult(stats=[w.stats for w in workers])


def _services(
    settings: RelaySettings,
    operate: Operations,
    pool: AsyncConnectionPool[Any],
    destinations: Destinations,
    shared: Shared,
    events: list[asyncio.Event],
    metrics: RelayMetrics | None,
    member: Member | None,
    partitioned: bool = False,
) -> list[Service]:
    """The background duties of this run, in the order they start (and the reverse of the
    order they close): what the settings turn on."""
    # A destination the start-up check did not find is looked at again until it is there.
    services: list[Service] = [Duty("destination watch", destinations.watch)]
    if member is not None:
        if metrics is not None:  # the process serves the endpoint; each outbox reads its own gauges
            services.append(_gauge_refresh(metrics, pool, settings))
    elif metrics is not None and operate.metrics_port is not None:
        services += _metrics_services(settings, operate, pool, destinations, shared, metrics)
    presence = shared.presence
    if presence is not None and member is not None and member.channels is not None:
        # The process's one LISTEN connection to this database wakes this outbox's workers.
        channels = member.channels
        removes: list[Callable[[], None]] = []

        async def join() -> None:
            removes.append(channels.add(settings.names, events, on_listening=presence.set_listening))

        async def leave() -> None:
            for remove in removes:
                remove()

        services.append(Duty("wake-up listener", _until_stopped, opening=join, closing=leave))
    elif presence is not None and member is None:
        services.append(
            Duty(
                "wake-up listener",
                lambda stop: listen(settings.dsn, settings.names, events, stop, on_listening=presence.set_listening),
            )
        )
    if presence is not None:
        # Neither idle nor working any more once closed: producers stop counting it.
        services.append(Duty("presence", presence.keep_alive, closing=presence.close))
    if partitioned:
        # Partitions ahead of the ids producers will get: one relay of the outbox makes them
        # (a producer's insert fails where no partition takes its id).
        ahead = Every("partitions ahead", PARTITIONS_AHEAD_CHECK, lambda: _keep_ahead(settings))
        services.append(Elected(ahead, settings.dsn, settings.names, duty="partitions"))
    if operate.prune_older_than is not None:
        older_than, heads = operate.prune_older_than, operate.prune_heads_idle_for
        prune = Every("scheduled prune", operate.prune_interval, lambda: _prune(settings, older_than, heads))
        # One relay of the outbox prunes; the others stand by and take over if it goes.
        services.append(Elected(prune, settings.dsn, settings.names, duty="prune"))
    return services


def _metrics_services(
    settings: RelaySettings,
    operate: Operations,
    pool: AsyncConnectionPool[Any],
    destinations: Destinations,
    shared: Shared,
    metrics: RelayMetrics,
) -> list[Service]:
    """The metrics and health endpoint (bound at start: a port that cannot be bound refuses
    the start), and the gauges it serves, read from the table every GAUGE_REFRESH_S."""
    from relay.httpd import all_ready, pool_check, serve

    port = operate.metrics_port
    assert port is not None
    server: list[asyncio.Server] = []

    async def bind() -> None:
        ready_check = all_ready(pool_check(pool, settings.names), _broker_check(shared, destinations))
        server.append(await serve(port, metrics.registry, ready_check, host=operate.metrics_host))
        log.info("metrics and health on %s:%d (/metrics, /healthz, /readyz)", operate.metrics_host, port)

    async def unbind() -> None:
        for s in server:
            s.close()
            await s.wait_closed()

    return [
        Duty("metrics endpoint", _until_stopped, opening=bind, closing=unbind),
        _gauge_refresh(metrics, pool, settings),
    ]


def _gauge_refresh(metrics: RelayMetrics, pool: AsyncConnectionPool[Any], settings: RelaySettings) -> Service:
    return Every("gauge refresh", timedelta(seconds=GAUGE_REFRESH_S), lambda: _refresh_gauges(metrics, pool, settings))


def _broker_check(shared: Shared, destinations: Destinations) -> Callable[[], Awaitable[tuple[bool, str]]]:
    """Readiness of the broker side: the process's breaker closed, every destination there."""

    async def check() -> tuple[bool, str]:
        reason = not_ready(shared.breaker, destinations)
        if reason is not None:
            return False, reason
        return True, "broker and destinations accepting messages"

    return check


async def _until_stopped(stop: asyncio.Event) -> None:
    await stop.wait()


async def _refresh_gauges(metrics: RelayMetrics, pool: AsyncConnectionPool[Any], settings: RelaySettings) -> None:
    async with pool.connection() as conn:
        await metrics.refresh_gauges(conn, settings.names)


async def _keep_ahead(settings: RelaySettings) -> None:
    conn = await connect(settings.dsn)
    async with conn:
        await keep_ahead(conn, settings.names)  # logs the partitions it makes


async def _prune(settings: RelaySettings, older_than: timedelta, heads_idle_for: timedelta | None) -> None:
    from relay.retention import prune

    # A connection of its own: a first prune of a long history can take minutes, and
    # must not hold a pool slot a worker needs.
    conn = await connect(settings.dsn)
    async with conn:
        # The store the relay writes to (the bucket is in each object's reference); AWS S3
        # when the claim-check is off, for objects written while it was on.
        cc = settings.claim_check
        payloads = StoredPayloads(cc.endpoint_url, cc.region) if cc is not None else StoredPayloads()
        result = await prune(conn, settings.names, older_than, heads_idle_for=heads_idle_for, payloads=payloads)
    dropped = result.partitions
    log.info(
        "scheduled prune removed %d done rows older than %s %s%s",
        result.done,
        older_than,
        f"in {result.batches} batches"
        if dropped is None
        else f"with {len(dropped.dropped)} partitions dropped, {len(dropped.kept) + dropped.more_kept} kept"
        + (f" ({dropped.refused})" if dropped.refused else ""),
        "" if result.heads is None else f", and forgot {result.heads.forgotten} idle aggregates' counters",
    )
