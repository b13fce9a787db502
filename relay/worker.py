"""The dispatch loop: claim, publish outside any transaction, fenced finalize.

The loop never sees SQL (that is :mod:`relay.store`) nor SDK types (those stay in
``adapters/``). It holds no connection, transaction or row lock while it publishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import psycopg

from adapters.base import Outcome, Publisher
from relay.backoff import Backoff
from relay.decide import Policy, is_classified
from relay.errors import BrokerUnavailable, RetryableError
from relay.message import Decision, OutboxMessage
from relay.sleep import sleep_unless_stopped
from relay.store import OutboxStore

log = logging.getLogger("relay.worker")

# A worker that finds full batches runs the ingest and the reaper at most this often;
# one that finds less runs them on every claim. Ten times a second per worker keeps new
# aggregates and expired leases waiting well under the poll interval.
HOUSEKEEPING_INTERVAL_S = 0.1


@dataclass(frozen=True)
class WorkerConfig:
    batch_size: int = 100
    lease: timedelta = timedelta(seconds=60)
    publish_timeout: timedelta = timedelta(seconds=20)
    poll_interval: timedelta = timedelta(seconds=1)
    policy: Policy = field(default_factory=Policy)
    # Backoff for the worker itself after a database error, before it claims again.
    db_backoff: Backoff = field(default_factory=lambda: Backoff(timedelta(milliseconds=200), timedelta(seconds=10)))


@dataclass
class WorkerStats:
    claimed: int = 0
    published: int = 0
    retried: int = 0
    deferred: int = 0
    dead: int = 0
    released: int = 0
    lost_leases: int = 0
    reaped: int = 0
    broker_unavailable: int = 0


class Worker:
    """One dispatch loop. Several run side by side in a process, and several processes on
    several machines; they coordinate only through the outbox table."""

    def __init__(
        self,
        *,
        store: OutboxStore,
        publisher: Publisher,
        owner: str,
        config: WorkerConfig,
        wakeup: asyncio.Event | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.owner = owner
        self.config = config
        self.wakeup = wakeup or asyncio.Event()
        self.stats = WorkerStats()
        self._ordered_first = True
        self._broker_failures = 0  # consecutive batches the broker refused as a whole
        self._last_housekeeping = float("-inf")
        self._saturated = False  # the last claim came back full

    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch until ``stop`` is set; the batch in hand is finished first."""
        db_failures = 0
        while not stop.is_set():
            try:
                claimed = await self.run_once()
                db_failures = 0
            except psycopg.OperationalError as exc:
                db_failures += 1
                delay = self.config.db_backoff.delay(db_failures).total_seconds()
                log.warning(
                    "database error, retrying in %.1fs: %s",
                    delay,
                    first_line(exc),
                    extra={"worker": self.owner},
                )
                await sleep_unless_stopped(stop, delay)
                continue
            if self._broker_failures:
                # The broker refused the whole batch; wait out the backoff before claiming
                # again, so an outage is not turned into a busy loop of claims.
                await sleep_unless_stopped(
                    stop, self.config.policy.outage_backoff.delay(self._broker_failures).total_seconds()
                )
            elif claimed == 0:
                # Only an empty claim means "nothing to do". A short batch does not: an
                # ordered claim leases one head per aggregate, and the next heads become
                # ready the moment this batch is finalized.
                await self._idle(stop)

    async def _idle(self, stop: asyncio.Event) -> None:
        """Sleep for the poll interval, or less if a wake-up or stop arrives."""
        self.wakeup.clear()
        waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wakeup.wait())}
        try:
            await asyncio.wait(
                waiters,
                timeout=self.config.poll_interval.total_seconds(),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def run_once(self) -> int:
        """Claim one batch, publish it, finalize it. Returns how many rows were claimed."""
        now = time.monotonic()
        housekeeping = not self._saturated or now - self._last_housekeeping >= HOUSEKEEPING_INTERVAL_S
        if housekeeping:
            self._last_housekeeping = now
        claim = await self.store.claim(
            owner=self.owner,
            batch=self.config.batch_size,
            lease=self.config.lease,
            max_attempts=self.config.policy.max_attempts,
            ordered_first=self._ordered_first,
            housekeeping=housekeeping,
        )
        self._ordered_first = not self._ordered_first
        self._saturated = len(claim.messages) >= self.config.batch_size
        for row in claim.reaped:
            if row.status != "dead":
                log.info(
                    "lease expired; message returned to pending",
                    extra={
                        "outbox_id": row.id,
                        "aggregate_id": row.aggregate_id,
                        "event_type": row.event_type,
                        "lease_version": row.lease_version,
                    },
                )
                continue
            self.stats.reaped += 1
            log.warning(
                "lease expired on the last attempt; message sent to dead",
                extra={
                    "outbox_id": row.id,
                    "aggregate_id": row.aggregate_id,
                    "event_type": row.event_type,
                    "lease_version": row.lease_version,
                    "attempts": row.attempts,
                },
            )
        messages = claim.messages
        if not messages:
            return 0
        self.stats.claimed += len(messages)
        try:
            outcomes = await self._publish(messages)
        except asyncio.CancelledError:
            # Shutdown past its grace period: hand the rows back now, attempt refunded,
            # rather than leave them leased until the lease runs out. A message the broker
            # did get before the cancel is sent again: consumers de-duplicate by id.
            await asyncio.shield(self._finalize([Decision.released(m) for m in messages]))
            raise
        self._broker_failures = (
            self._broker_failures + 1 if all(isinstance(o, BrokerUnavailable) for o in outcomes) else 0
        )
        decisions = [
            self.config.policy.decide(m, o, broker_failures=max(self._broker_failures, 1))
            for m, o in zip(messages, outcomes, strict=True)
        ]
        _log_unclassified(outcomes)
        # Shielded: once the broker has the messages, a cancellation (shutdown) must not
        # lose the write that records it.
        await asyncio.shield(self._finalize(decisions))
        return len(messages)

    async def _publish(self, messages: Sequence[OutboxMessage]) -> list[Outcome]:
        timeout = self.config.publish_timeout.total_seconds()
        try:
            async with asyncio.timeout(timeout):
                outcomes = list(await self.publisher.publish(messages))
        except TimeoutError:
            # The broker may or may not have them: retry (consumers de-duplicate by id).
            error = RetryableError(f"publish timed out after {timeout:g}s")
            return [error] * len(messages)
        except Exception as exc:  # the adapter raised for the whole batch
            return [exc] * len(messages)
        if len(outcomes) != len(messages):
            name = self.publisher.name
            bug = RuntimeError(f"publisher {name!r} returned {len(outcomes)} outcomes for {len(messages)} messages")
            return [bug] * len(messages)
        return outcomes

    async def _finalize(self, decisions: Sequence[Decision]) -> None:
        refused = await self.store.finalize(decisions)
        for d in decisions:
            fields = d.message.log_fields()
            if d.message.id in refused:
                self.stats.lost_leases += 1
                log.warning(
                    "lost lease: finalize refused, the row belongs to a newer claim",
                    extra={**fields, "outcome": d.kind},
                )
                continue
            self._count(d)
            if d.kind == "dead":
                log.error("message sent to dead: %s", d.error, extra=fields)
            elif d.kind in ("retry", "broker_unavailable"):
                log.info("message rescheduled in %.1fs: %s", d.delay_s, d.error, extra=fields)
            elif d.kind == "defer":
                log.info("message deferred for %.1fs: %s", d.delay_s, d.error, extra=fields)

    def _count(self, d: Decision) -> None:
        if d.kind == "published":
            self.stats.published += 1
        elif d.kind == "retry":
            self.stats.retried += 1
        elif d.kind == "defer":
            self.stats.deferred += 1
        elif d.kind == "dead":
            self.stats.dead += 1
        elif d.kind == "released":
            self.stats.released += 1
        else:
            self.stats.broker_unavailable += 1


def _log_unclassified(outcomes: Sequence[Outcome]) -> None:
    """One traceback per distinct unclassified exception (a whole batch often shares one)."""
    seen: set[int] = set()
    for outcome in outcomes:
        if outcome is None or is_classified(outcome) or id(outcome) in seen:
            continue
        seen.add(id(outcome))
        log.error(
            "unclassified publisher error (a bug in the adapter): the messages go to dead",
            exc_info=(type(outcome), outcome, outcome.__traceback__),
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
