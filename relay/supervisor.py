"""One supervisor for everything a running relay runs: its background duties
(:mod:`relay.services`) and its workers.

Order: every duty is started (a failure there refuses the start, and what was started is
closed); the duties run; the workers run; then, once ``stop`` is set, a worker fails or
the supervising task is cancelled, the workers are drained (:func:`supervise_workers`),
the duties stopped and closed, in reverse order. A duty that fails while it runs is
logged with its traceback and started again after a pause that grows with each failure
in a row: a background duty never takes the workers down, and never stops silently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Coroutine, Sequence
from datetime import timedelta
from typing import Any

from relay.backoff import Backoff
from relay.dsn import mask
from relay.errors import first_line
from relay.services import Service
from relay.sleep import sleep_unless_stopped

log = logging.getLogger("relay.supervisor")

# The pause before a failed duty is started again: a second, doubling to a minute (its
# ceiling, not a random draw: one process's duties need no spreading).
RESTART = Backoff(base=timedelta(seconds=1), cap=timedelta(minutes=1))
# A duty that ran this long before it failed starts its count of failures again.
HEALTHY_RUN_S = 60.0


class Supervisor:
    """Starts, watches and stops ``services`` around the workers of one run."""

    def __init__(self, services: Sequence[Service], *, restart: Backoff = RESTART) -> None:
        self.services = list(services)
        self.restart = restart

    async def run(
        self,
        workers: Sequence[Coroutine[Any, Any, None]],
        stop: asyncio.Event,
        grace: timedelta,
        *,
        ready: asyncio.Event | None = None,
        names: Sequence[str] = (),
    ) -> None:
        """Start the duties, then run ``workers`` (coroutines, each a worker's loop; named
        ``names``) until they end; see :func:`supervise_workers` for how they are stopped.
        ``ready`` is set once every duty has started and the workers run."""
        started: list[Service] = []
        duties: list[asyncio.Task[None]] = []
        try:
            for service in self.services:
                await service.start()
                started.append(service)
            duties = [asyncio.create_task(self._keep(s, stop), name=f"relay duty {s.name}") for s in started]
            tasks = [
                asyncio.create_task(w, name=names[i] if i < len(names) else f"relay worker {i}")
                for i, w in enumerate(workers)
            ]
            workers = []  # owned by the tasks now
            if ready is not None:
                ready.set()
            await supervise_workers(tasks, stop, grace)
        finally:
            for coroutine in workers:  # a start that failed: never scheduled
                coroutine.close()
            stop.set()
            for task in duties:
                task.cancel()
            await asyncio.gather(*duties, return_exceptions=True)
            for service in reversed(started):
                try:
                    await service.close()
                except Exception:
                    log.exception("closing %s failed", service.name)

    async def _keep(self, service: Service, stop: asyncio.Event) -> None:
        """Run ``service`` until ``stop``; start it again after a pause whenever it fails."""
        failures = 0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            began = loop.time()
            try:
                await service.run(stop)
                return
            except Exception as exc:
                failures = 1 if loop.time() - began >= HEALTHY_RUN_S else failures + 1
                pause = self.restart.ceiling(failures)
                log.error(
                    "%s failed (%s); starting it again in %gs",
                    service.name,
                    mask(f"{type(exc).__name__}: {first_line(exc)}"),
                    pause,
                    exc_info=exc,
                )
                await sleep_unless_stopped(stop, pause)


# A cancelled run gives the workers this long (or --shutdown-grace, if shorter) to end on
# their own before it cancels them: a claim or a finalize in progress takes milliseconds,
# and cut short it would leave its rows leased (a claim whose answer was lost) or a
# published batch unrecorded until the lease runs out. A publish still running after it
# is cancelled, and its rows handed back. A cancel means "now": a second, not the grace.
CANCEL_GRACE = timedelta(seconds=1)


async def supervise_workers(tasks: Sequence[asyncio.Task[None]], stop: asyncio.Event, grace: timedelta) -> None:
    """Wait for the workers; once ``stop`` is set or one of them fails, give them
    ``grace`` to finish the batch in hand, then cancel the rest (their rows go back, attempt
    refunded) and raise a worker's error, if there was one.

    Cancelled itself, it stops at once: ``stop`` is set and the workers get
    :data:`CANCEL_GRACE` at most. Either way it returns only once every worker has ended,
    however often it is cancelled meanwhile (the pool and the broker connection are closed
    next, and a worker still writing its rows back would find them gone); then the
    CancelledError goes on."""
    stopping = asyncio.create_task(stop.wait())
    cancel: asyncio.CancelledError | None = None
    failed: list[BaseException] = []
    try:
        try:
            done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
            failed = [e for t in done if t is not stopping and not t.cancelled() and (e := t.exception()) is not None]
        except asyncio.CancelledError as exc:
            cancel = exc
        stop.set()
        if cancel is not None:
            grace = min(grace, CANCEL_GRACE)
            log.info("cancelled: stopping, the batches in hand get %gs", grace.total_seconds())
        elif not failed:
            log.info("stopping: finishing the batches in hand (grace %gs)", grace.total_seconds())
        try:
            _, pending = await asyncio.wait(tasks, timeout=grace.total_seconds())
        except asyncio.CancelledError as exc:  # cancelled during the grace: that was long enough
            cancel = cancel or exc
            pending = {t for t in tasks if not t.done()}
        for task in pending:
            # Each worker is cancelled once: its writes run to their end under a cancel
            # (relay.worker.to_the_end), and a second cancel would only be raised again.
            if not task.cancelling():
                task.cancel()
        if pending:
            log.warning("grace period over: abandoned %d in-flight batches", len(pending))
            cancel = await wait_for_all(pending) or cancel
        if cancel is not None:
            raise cancel
        if failed:
            raise failed[0]
    finally:
        stopping.cancel()
        await asyncio.gather(stopping, return_exceptions=True)


async def wait_for_all(
    tasks: Collection[asyncio.Task[None]], *, cancel_them: bool = False
) -> asyncio.CancelledError | None:
    """Wait until every one of ``tasks`` has ended, however often the caller is cancelled
    meanwhile (``cancel_them``: then cancel them too); the last such cancel, for the caller
    to raise once they have."""
    cancel: asyncio.CancelledError | None = None
    while not all(t.done() for t in tasks):
        try:
            await asyncio.wait(tasks)
        except asyncio.CancelledError as exc:
            cancel = exc
            if cancel_them:
                for task in tasks:
                    task.cancel()
    return cancel
