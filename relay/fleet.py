"""Several outboxes in one relay process (``[[outboxes]]`` in the config file, or
``relay.Relay(outboxes=[...])``).

Each outbox runs as it would alone (:func:`relay.runner.run_relay`: its own workers,
leases, ordering, breaker, duties), in a task of its own, and borrows from the process
what would otherwise be repeated per outbox:

* one pool per database (the same DSN and session limits), sized for every outbox on it:
  each outbox's workers plus one, so an outbox whose statements hang (a lock, a slow
  disk) can hold only its own share; idle, it keeps two connections open;
* one LISTEN connection per database, each outbox's notifications waking its own workers;
* one publisher per distinct destination setting (one broker connection), started before
  the outboxes and closed after them;
* one metrics endpoint, every series labelled ``outbox``; ``/readyz`` answers for each.

Isolation: an outbox whose run fails (its database refuses the login or is read-only, its
grants were revoked, its table is missing or not migrated, a bug) is logged, held, and
started again after a pause that grows to a minute, while the others deliver; one whose
database goes away waits for it inside its run, as a lone relay does. Fairness: the workers of
every outbox take turns on one event loop, each turn a step of one batch, never a whole
backlog; a worker that wakes from idle with work goes before the workers draining a
backlog (relay.arrivals); the pools hand connections out first come, first served.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from psycopg_pool import AsyncConnectionPool

from relay.arrivals import Arrivals
from relay.backoff import Backoff
from relay.compose import FleetParts, OutboxParts
from relay.config import RelaySettings
from relay.contract import Publisher, WatchesDestinations
from relay.db.session import SessionLimits, open_pool
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, first_line
from relay.logs import OUTBOX
from relay.member import Member
from relay.runner import run_relay, unless_stopped
from relay.runner import started as start_publisher
from relay.sleep import sleep_unless_stopped
from relay.supervisor import RESTART, wait_for_all
from relay.wakeup import Channels

if TYPE_CHECKING:
    from relay.httpd import Readiness
    from relay.metrics import RelayMetrics

log = logging.getLogger("relay.fleet")

# Connections a shared pool keeps open while its outboxes are idle.
IDLE_CONNECTIONS = 2
# How long an outbox's first start may take before the process counts it as held and
# reports itself started (relay.Relay.start returns): the others should not wait for a
# database that does not answer.
FIRST_START_S = 10.0


async def run_fleet(
    fleet: FleetParts,
    stop: asyncio.Event,
    *,
    ready: asyncio.Event | None = None,
    restart: Backoff = RESTART,
) -> None:
    """Run every outbox of ``fleet`` until ``stop`` (see the module docstring). ``ready``
    is set once each outbox delivers or has been found held, and the endpoint is bound."""
    metrics: RelayMetrics | None = None
    if fleet.operations.metrics_port is not None:
        from relay.metrics import RelayMetrics  # prometheus-client only when asked for

        metrics = RelayMetrics(outboxes=True)
    pools: dict[tuple[str, SessionLimits], AsyncConnectionPool[Any]] = {}
    channels: dict[str, Channels] = {}
    members: list[tuple[OutboxParts, Member]] = []
    arrivals = Arrivals()
    started: list[Publisher] = []
    tasks: list[asyncio.Task[None]] = []
    server: asyncio.Server | None = None
    try:
        for key, size in _pool_sizes(fleet).items():
            pools[key] = await open_pool(key[0], size, key[1], least=IDLE_CONNECTIONS, probe=False)
        for outbox in fleet.outboxes:
            s = outbox.parts.settings
            listen = channels.setdefault(s.dsn, Channels()) if s.notify else None
            member = Member(
                outbox.name,
                pools[(s.dsn, s.session)],
                channels=listen,
                arrivals=arrivals,
                metrics=None if metrics is None else metrics.for_outbox(outbox.name),
            )
            members.append((outbox, member))
        for publisher in fleet.publishers:
            # Closed below whether or not it got through: a start cut short by a stop may
            # have opened a connection.
            started.append(publisher)
            if await unless_stopped(stop, "connecting to the broker", start_publisher(publisher)) is None:
                return
            if isinstance(publisher, WatchesDestinations):
                publisher.watch_destinations(_fan_out([m for o, m in members if o.parts.publisher is publisher]))
        if metrics is not None:
            from relay.httpd import serve

            port = fleet.operations.metrics_port
            assert port is not None
            server = await serve(port, metrics.registry, _ready_check(members), host=fleet.operations.metrics_host)
        log.info(
            "relay started: %d outboxes (%s), %d database pools, %d broker connections",
            len(members),
            ", ".join(o.name for o, _ in members[:10]) + (", ..." if len(members) > 10 else ""),
            len(pools),
            len(started),
        )
        for dsn, listening in channels.items():
            tasks.append(asyncio.create_task(listening.listen(dsn, stop), name="relay wake-up listener"))
        for outbox, member in members:
            context = contextvars.copy_context()
            context.run(OUTBOX.set, outbox.name)
            tasks.append(
                asyncio.create_task(
                    _keep(outbox, member, stop, restart), name=f"relay outbox {outbox.name}", context=context
                )
            )
        if ready is not None:
            await _first_starts([m for _, m in members], stop)
            ready.set()
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        if tasks:
            # Each outbox's run drains its own workers when stopped; a cancel reaches them too.
            await _all_ended(tasks)
        if server is not None:
            server.close()
            await server.wait_closed()
        for publisher in started:
            try:
                await publisher.close()
            except Exception as exc:
                log.warning("closing the %s publisher failed: %s", publisher.name, first_line(exc))
        for pool in pools.values():
            await pool.close()


def _pool_sizes(fleet: FleetParts) -> dict[tuple[str, SessionLimits], int]:
    """One pool per database and session limits, with room for each of its outboxes'
    workers and one spare each (what each would have alone)."""
    sizes: dict[tuple[str, SessionLimits], int] = {}
    for outbox in fleet.outboxes:
        s: RelaySettings = outbox.parts.settings
        key = (s.dsn, s.session)
        sizes[key] = sizes.get(key, 0) + s.workers + 1
    return sizes


def _fan_out(members: list[Member]) -> Callable[[str, bool], None]:
    """A shared publisher's destination changes, told to every outbox that uses it."""

    def changed(name: str, is_open: bool) -> None:
        for member in members:
            for listener in list(member.on_destination):
                listener(name, is_open)

    return changed


async def _keep(outbox: OutboxParts, member: Member, stop: asyncio.Event, restart: Backoff) -> None:
    """Run one outbox until ``stop``; whatever ends its run early holds it, and it is started
    again after a pause (growing to a minute while it keeps failing)."""
    parts = outbox.parts
    failures = 0
    while not stop.is_set():
        began = time.monotonic()
        # A stop of its own: a run that ends sets its stop, which must not end the others.
        own = asyncio.Event()
        relayed = asyncio.ensure_future(_relay_stop(stop, own))
        try:
            await run_relay(
                parts.settings,
                parts.publisher,
                own,
                operate=parts.operations,
                given=parts.given,
                tracing=parts.tracing,
                member=member,
            )
            reason = None if stop.is_set() else "its run ended"
        except (ConfigError, DatabaseUnavailable) as exc:
            reason = first_line(exc)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {first_line(exc)}"
            log.error("outbox %s stopped: %s", outbox.name, mask(reason), exc_info=exc)
        finally:
            relayed.cancel()
        if stop.is_set():
            return
        failures = 1 if time.monotonic() - began >= 60 else failures + 1
        pause = restart.ceiling(failures)
        member.hold(mask(reason or "stopped"))
        log.error("outbox %s is held, its run starts again in %gs: %s", outbox.name, pause, mask(reason or ""))
        await sleep_unless_stopped(stop, pause)


async def _relay_stop(stop: asyncio.Event, own: asyncio.Event) -> None:
    await stop.wait()
    own.set()


async def _first_starts(members: list[Member], stop: asyncio.Event) -> None:
    """Wait until every outbox delivers or has been held (or FIRST_START_S has passed)."""
    deadline = time.monotonic() + FIRST_START_S
    while not stop.is_set() and time.monotonic() < deadline:
        if all(m.held != "starting" for m in members):
            return
        await sleep_unless_stopped(stop, 0.05)


def _ready_check(members: list[tuple[OutboxParts, Member]]) -> Callable[[], Awaitable[Readiness]]:
    """``/readyz``: ready while every outbox is; a line per outbox, held ones first."""
    from relay.httpd import Readiness

    async def one(member: Member) -> tuple[bool, str]:
        if member.check is None:
            return False, f"held: {member.held or 'starting'}"
        try:
            ok, reason = (await member.check())[:2]
        except Exception as exc:
            return False, f"held: {type(exc).__name__}: {first_line(exc)}"
        return ok, "ready" if ok else f"held: {reason}"

    async def check() -> Readiness:
        found = await asyncio.gather(*(one(m) for _, m in members))
        lines = [(ok, f"outbox {o.name}: {text}") for (o, _), (ok, text) in zip(members, found, strict=True)]
        held = [o.name for (o, _), (ok, _) in zip(members, found, strict=True) if not ok]
        details = tuple(line for ok, line in sorted(lines, key=lambda x: x[0]))
        if held:
            shown = ", ".join(held[:10]) + (", ..." if len(held) > 10 else "")
            return Readiness(False, f"{len(held)} of {len(members)} outboxes held: {shown}", details)
        return Readiness(True, f"{len(members)} outboxes delivering", details)

    return check


async def _all_ended(tasks: list[asyncio.Task[None]]) -> None:
    """Wait for every task, however often the caller is cancelled meanwhile; cancel them
    on a cancel, and raise it once they have ended."""
    cancel = await wait_for_all(tasks, cancel_them=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed: %s", task.get_name(), first_line(task.exception() or Exception()))
    if cancel is not None:
        raise cancel
