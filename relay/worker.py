"""The dispatch loop: claim, publish outside any transaction, fenced finalize.

The loop never sees SQL (that is :mod:`relay.db.dispatch`) nor SDK types (those stay in
``relay/adapters/``). It holds no connection, transaction or row lock while it publishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol, TypeVar

from relay.arrivals import Arrivals
from relay.backoff import Backoff
from relay.breaker import CircuitBreaker
from relay.claimcheck import ClaimCheckStore
from relay.contract import DEFAULT_PUBLISH_TIMEOUT, Outcome, Publisher, publish_within
from relay.db.dispatch import DEFAULT_BATCH_BYTES, OutboxStore, Reaped
from relay.db.session import TRANSIENT_DB_ERRORS
from relay.decide import Policy, describe, failure_class
from relay.errors import BrokerUnavailable, DestinationUnavailable, SharedFailure, first_line, is_classified
from relay.isolation import PublishTurns
from relay.message import Decision, Kind, OutboxMessage, log_fields
from relay.oversize import OversizeTurn
from relay.sleep import sleep_unless_stopped
from relay.tracing import NO_TRACING, Tracing
from relay.wakeup import Presence

log = logging.getLogger("relay.worker")

T = TypeVar("T")

# While claims come back full, the ingest and the reaper run at most this often in a
# process (one claim of one worker carries them); a claim that finds less runs them
# itself. Ten times a second keeps new aggregates and expired leases waiting well under
# the poll interval, and spares the busy process the five statements they take.
HOUSEKEEPING_INTERVAL_S = 0.1
# Idle polls come after 90-100% of the poll interval (Worker._idle).
POLL_JITTER = 0.1


class Housekeeping:
    """When a process's workers last ran the reaper and the ingest (shared by them)."""

    def __init__(self) -> None:
        self.last = float("-inf")

    def due(self, now: float, *, busy: bool) -> bool:
        """Whether a claim at ``now`` carries them: always unless ``busy`` (the worker's
        last claim came back full and the last ingest kept up), else once an interval;
        a claim that carries them takes the turn."""
        if busy and now - self.last < HOUSEKEEPING_INTERVAL_S:
            return False
        self.last = now
        return True


def lease_margin(lease: timedelta) -> timedelta:
    """How long before its lease expires a publish is abandoned: time for the finalize to
    land, and for the claim's own latency (the lease started at the database). 10% of the
    lease, at most 2 s: a 60 s lease keeps 2 s, a 5 s lease half a second."""
    return min(timedelta(seconds=2), lease / 10)


@dataclass(frozen=True)
class WorkerConfig:
    batch_size: int = 100
    # While claims come back full, each leases twice as many rows as the last, up to this
    # (None: batch_size, no growth); a short claim starts again from batch_size. A backlog
    # then costs fewer claims, finalizes and publishes, each for more messages.
    max_batch_size: int | None = None
    batch_bytes: int = DEFAULT_BATCH_BYTES  # payload bytes one claim leases (a larger message alone)
    lease: timedelta = timedelta(seconds=60)
    publish_timeout: timedelta = DEFAULT_PUBLISH_TIMEOUT
    poll_interval: timedelta = timedelta(seconds=1)
    policy: Policy = field(default_factory=Policy)
    # Claim the next batch while one publishes (Worker.run); off: claim, publish,
    # finalize one after another.
    pipeline: bool = True
    # Backoff for the worker itself after a database error, before it tries again.
    db_backoff: Backoff = field(default_factory=lambda: Backoff(timedelta(milliseconds=200), timedelta(seconds=10)))

    @property
    def lease_margin(self) -> timedelta:
        return lease_margin(self.lease)


# Why rows went back unpublished (last_error; the attempt is refunded in each case).
RELEASED_AT_SHUTDOWN = "released unpublished at shutdown"
RELEASED_BROKER_REFUSED = "released unpublished: the broker refused a batch, claims pause"
LEASE_RAN_OUT = "released unpublished: too little of its lease was left to publish"
# A batch claimed ahead is published only while at least this share of its publish
# deadline is left in its lease (Worker._deadline). With the defaults (60 s lease, 20 s
# publish timeout) it always has the whole deadline: it waits one publish at most.
MIN_DEADLINE_SHARE = 0.5


@dataclass
class Batch:
    """Rows one claim leased, in id order, to be published."""

    messages: list[OutboxMessage]
    # time.monotonic() when the claim was sent: the lease, which started at the database
    # after that, is counted from here (a conservative start).
    claimed_at: float
    probe: bool = False
    ahead: bool = False  # claimed while the batch before it published
    oversize: bool = False  # holds the process's oversize turn until it is finalized

    @property
    def payload_bytes(self) -> int:
        return sum(m.body_size for m in self.messages)


@dataclass(frozen=True)
class Finished:
    """A published batch's outcomes, not written yet."""

    decisions: list[Decision] = field(default_factory=list)
    oversize: bool = False  # the batch held the oversize turn: free it once written


@dataclass
class WorkerStats:
    claimed: int = 0
    isolated: int = 0  # messages published apart after their batch failed as a whole
    published: int = 0
    retried: int = 0
    deferred: int = 0
    dead: int = 0
    released: int = 0
    lost_leases: int = 0
    reaped: int = 0
    broker_unavailable: int = 0


class MetricsSink(Protocol):
    """What the loop reports (relay.metrics.RelayMetrics implements it)."""

    def messages(self, event_type: str, outcome: Kind, n: int = 1) -> None: ...

    def failure(self, event_type: str, error_class: str, n: int = 1) -> None: ...

    def lost_lease(self) -> None: ...

    def reaped(self) -> None: ...

    def observe_claim(self, seconds: float) -> None: ...

    def observe_publish(self, seconds: float) -> None: ...


class NoMetrics:
    def messages(self, event_type: str, outcome: str, n: int = 1) -> None:
        pass

    def failure(self, event_type: str, error_class: str, n: int = 1) -> None:
        pass

    def lost_lease(self) -> None:
        pass

    def reaped(self) -> None:
        pass

    def observe_claim(self, seconds: float) -> None:
        pass

    def observe_publish(self, seconds: float) -> None:
        pass


@dataclass
class Shared:
    """What the workers of one process share: one circuit breaker (the broker refusing a
    whole batch stops every worker's claims), one oversize turn (one message over
    ``batch_bytes`` in flight), one publish turn (a batch that failed as a whole is
    published apart while nothing else publishes), the metrics, the tracing, and the
    process's presence row (only when it LISTENs), the housekeeping's clock, and in a process
    serving several outboxes the arrivals of all of them (relay.arrivals). A worker made
    without one gets its own."""

    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    metrics: MetricsSink | None = None
    oversize: OversizeTurn = field(default_factory=OversizeTurn)
    turns: PublishTurns = field(default_factory=PublishTurns)
    tracing: Tracing | None = None
    presence: Presence | None = None
    housekeeping: Housekeeping = field(default_factory=Housekeeping)
    # The process serves several outboxes: workers waking from idle go before draining ones.
    arrivals: Arrivals | None = None
    # --claim-check-bucket: large payloads are stored there and referenced (relay.claimcheck).
    claim_check: ClaimCheckStore | None = None


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
        shared: Shared | None = None,
    ) -> None:
        """``wakeup``: set when a producer's NOTIFY (or the process) says rows wait; the
        worker otherwise polls every ``config.poll_interval``. ``shared``: what the
        process's workers share (:class:`Shared`)."""
        shared = shared or Shared()
        self.store = store
        self.publisher = publisher
        self.owner = owner
        self.config = config
        self.wakeup = wakeup or asyncio.Event()
        self.breaker = shared.breaker
        self.metrics: MetricsSink = shared.metrics or NoMetrics()
        self.oversize = shared.oversize
        self.presence = shared.presence
        self.tracing = shared.tracing or NO_TRACING
        self.turns = shared.turns
        self.housekeeping = shared.housekeeping
        self.arrivals = shared.arrivals
        self.claim_check = shared.claim_check
        self.stats = WorkerStats()
        self._batch_size = config.batch_size  # grows while claims come back full
        self._saturated = False  # the last claim came back full
        self._ingest_behind = False  # the last ingest took a whole turn; run the next one at once

    async def run(self, stop: asyncio.Event) -> None:
        """Dispatch until ``stop`` is set; the batch in hand is finished first.

        Pipelined: while one batch publishes, a database step writes the outcomes of the
        batch before it and then claims the next one (the *prefetch*), so the broker does
        not wait for the database, nor the database for the broker. A worker holds one
        pooled connection at a time (the step's, for its statements only: never while
        waiting for a publish), and at most two batches: the one publishing and the one
        claimed ahead, whose payloads together stay within ``batch_bytes``. Without a
        prefetched batch (the first claim, an empty or refused prefetch, a breaker probe,
        ``pipeline=False``) the loop is the plain claim, publish, finalize.
        """
        try:
            await self._run(stop)
        finally:
            self._leave()

    async def _run(self, stop: asyncio.Event) -> None:
        batch: Batch | None = None  # claimed, to be published next
        pending = Finished()  # published, outcomes not written yet
        db_failures = 0
        while True:
            if batch is None:
                # Nothing claimed ahead: write what is pending now (no publish to overlap
                # it with), then claim as the unpipelined loop does.
                with contextlib.suppress(*TRANSIENT_DB_ERRORS):
                    # To its end: a cancellation (shutdown) must not lose the write that
                    # records what the broker has. If the database stays away for a whole
                    # lease, _finalize logs it and the rows return through their leases.
                    await to_the_end(self._write(pending))
                pending = Finished()
                if stop.is_set():
                    return
                limit = await self.breaker.permit(stop)
                if stop.is_set():
                    return
                probe = limit is not None
                # Before the claim, not before the sleep: a wake-up that arrives while the
                # claim runs may be for a row it could not see yet, so the sleep must not
                # swallow it.
                self.wakeup.clear()
                try:
                    batch, leased = await self._claim_to_the_end(limit=limit, probe=probe)
                    if db_failures:
                        log.info("database reachable again", extra={"worker": self.owner})
                    db_failures = 0
                except TRANSIENT_DB_ERRORS as exc:
                    db_failures += 1
                    delay = self.config.db_backoff.delay(db_failures).total_seconds()
                    log.warning(
                        "database error, retrying in %.1fs: %s", delay, first_line(exc), extra={"worker": self.owner}
                    )
                    await sleep_unless_stopped(stop, delay)
                    continue
                if not batch.messages:
                    batch = None
                    if leased == 0 and not probe and not self._ingest_behind:
                        # Only an empty claim with nothing of ours in flight means "nothing
                        # to do". A short batch does not: an ordered claim leases one head
                        # per aggregate, and the next heads become ready the moment this
                        # batch is finalized. Nor does an ingest that took a whole turn:
                        # more committed rows wait to be numbered.
                        self._leave()
                        await self._idle(stop)
                        if self.arrivals is not None:
                            self.arrivals.arrive(self.owner)
                    continue
            ahead = self._prefetch_budget(batch, stop)
            step = asyncio.create_task(self._write_then_claim(pending, ahead))
            pending = Finished()
            decisions: list[Decision] | None = None
            try:
                decisions = await self._publish_batch(batch)
                following = await to_the_end(step)
            except asyncio.CancelledError:
                # Shutdown past its grace period: hand back what was not published, and what
                # was claimed ahead, attempts refunded, rather than leave the rows leased
                # until their leases run out. A message the broker did get before the cancel
                # is sent again: consumers de-duplicate by id.
                await to_the_end(self._abandon(batch, decisions, step))
                raise
            if following is not None and (stop.is_set() or self.breaker.is_open):
                # Stopping, or the broker has just refused a whole batch (ours or another
                # worker's): the batch claimed ahead goes back unpublished, attempts refunded.
                reason = RELEASED_AT_SHUTDOWN if stop.is_set() else RELEASED_BROKER_REFUSED
                decisions += [Decision.released(m, reason) for m in following.messages]
                following = None
            pending = Finished(decisions, oversize=batch.oversize)
            batch = following

    async def _idle(self, stop: asyncio.Event) -> None:
        """Sleep for the poll interval, or less if a wake-up or stop arrives."""
        if self.presence is not None and await self.presence.idle(self.owner):
            return  # the process has just told the producers it is idle: look once more first
        waiters = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.wakeup.wait())}
        try:
            # A tenth of jitter: the idle workers of a process (of many outboxes, relay.fleet)
            # that started together would otherwise poll in step, each round a burst of claims
            # that takes as many pool connections at once.
            timeout = self.config.poll_interval.total_seconds() * random.uniform(1 - POLL_JITTER, 1)
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
            if self.presence is not None:
                self.presence.awake(self.owner)

    async def run_once(self, *, limit: int | None = None, probe: bool = False) -> int:
        """Claim one batch (at most ``limit`` rows), publish it, finalize it: one turn of the
        loop without a prefetch. Returns how many rows were claimed."""
        batch, leased = await self._claim(limit=limit, probe=probe)
        if not batch.messages:
            return leased
        try:
            decisions = await self._publish_batch(batch)
        except asyncio.CancelledError:
            await to_the_end(self._abandon(batch, None, None))
            raise
        # To its end: once the broker has the messages, a cancellation (shutdown) must not
        # lose the write that records it.
        await to_the_end(self._write(Finished(decisions, oversize=batch.oversize)))
        return leased

    # ---- the steps of the loop

    def _prefetch_budget(self, batch: Batch, stop: asyncio.Event) -> int | None:
        """Payload bytes the next claim may lease while ``batch`` publishes, or None for no
        prefetch. None while stopping, for a breaker probe (one small batch) and while the
        breaker is open (claims would only move rows to 'processing' and back). The two
        batches share the byte budget, so a worker holds no more payload than unpipelined;
        a batch holding a message over the budget (the oversize turn) gets no company."""
        if not self.config.pipeline or stop.is_set() or batch.probe or self.breaker.is_open:
            return None
        left = self.config.batch_bytes - batch.payload_bytes
        return left if left > 0 else None

    async def _write_then_claim(self, done: Finished, budget: int | None) -> Batch | None:
        """The database step beside a publish: write the outcomes of the batch before, then
        (with a ``budget``) claim the next batch, whose ordered heads may be the successors
        that write has just made ready. Returns the batch claimed, if it holds messages.

        A database error ends the step quietly: a write that could not land within its
        lease was logged by :meth:`_finalize` (the rows return through their expired
        leases), and a failed claim is the next unpipelined claim's to retry and report."""
        try:
            await self._write(done)
            del done  # its bodies are not needed any more
            if budget is None:
                return None
            batch, _ = await self._claim(budget=budget)
        except TRANSIENT_DB_ERRORS as exc:
            log.debug("database step failed: %s", first_line(exc), extra={"worker": self.owner})
            return None
        return batch if batch.messages else None

    async def _abandon(
        self, batch: Batch, decisions: list[Decision] | None, step: asyncio.Task[Batch | None] | None
    ) -> None:
        """Cancelled (shutdown past its grace): write ``decisions`` if ``batch`` was
        published, else hand it back; let the database step finish and hand back what it
        claimed. Attempts of rows handed back are refunded."""
        if decisions is None:
            if batch.probe:
                self.breaker.record(unavailable=True, reason=self.breaker.reason, probe=True)
            decisions = [Decision.released(m) for m in batch.messages]
        following = await step if step is not None else None
        if following is not None:
            decisions += [Decision.released(m) for m in following.messages]
        await self._write(Finished(decisions, oversize=batch.oversize))

    async def _write(self, done: Finished) -> None:
        """Write a published batch's outcomes; then its oversize turn (if it held it) is free,
        and a worker that woke from idle has arrived."""
        try:
            if done.decisions:
                await self._finalize(done.decisions)
        finally:
            if done.oversize:
                self.oversize.release(self.owner)
            if done.decisions:
                self._leave()

    async def _give_way(self) -> None:
        """Before a step of a draining worker (its last claim came back full): an outbox of
        the process that woke with work goes first (relay.arrivals)."""
        if self.arrivals is not None and self._saturated:
            await self.arrivals.give_way()

    def _leave(self) -> None:
        if self.arrivals is not None:
            self.arrivals.leave(self.owner)

    async def _claim_to_the_end(self, *, limit: int | None, probe: bool) -> tuple[Batch, int]:
        """:meth:`_claim`, run to its end even when the worker is cancelled meanwhile (a
        claim cut in flight could commit its lease while the worker never learns of it:
        the rows would wait out their leases, an attempt spent); then its rows are handed
        back unpublished, attempts refunded, and the cancel goes on."""
        claiming = asyncio.ensure_future(self._claim(limit=limit, probe=probe))
        try:
            return await to_the_end(claiming)
        except asyncio.CancelledError:
            if claiming.done() and not claiming.cancelled() and claiming.exception() is None:
                claimed, _ = claiming.result()
                back = [Decision.released(m, RELEASED_AT_SHUTDOWN) for m in claimed.messages]
                await to_the_end(self._write(Finished(back, oversize=claimed.oversize)))
            raise

    async def _claim(
        self, *, limit: int | None = None, probe: bool = False, budget: int | None = None
    ) -> tuple[Batch, int]:
        """Claim one batch: at most ``limit`` rows, and ``budget`` payload bytes if given (a
        prefetch, which never takes a message over the budget) or else the configured
        budget, a larger message alone if this worker gets the process's oversize turn.
        Rows that cannot become messages go to dead at once. Returns the batch and how many
        rows were leased, unreadable ones included."""
        await self._give_way()
        started = time.monotonic()
        housekeeping = self.housekeeping.due(started, busy=self._saturated and not self._ingest_behind)
        batch_size = min(limit or self._batch_size, self._batch_size)
        # Only the worker holding the process's turn may claim a message over the budget.
        oversize = budget is None and self.oversize.take(self.owner)
        try:
            with self.tracing.claim_span(owner=self.owner, limit=batch_size, ahead=budget is not None) as span:
                claim = await self.store.claim(
                    owner=self.owner,
                    batch=batch_size,
                    batch_bytes=self.config.batch_bytes if budget is None else budget,
                    oversize=oversize,
                    lease=self.config.lease,
                    max_attempts=self.config.policy.max_attempts,
                    housekeeping=housekeeping,
                )
                span.claimed(
                    messages=len(claim.messages),
                    unreadable=len(claim.unreadable),
                    reaped=len(claim.reaped),
                    payload_bytes=sum(m.body_size for m in claim.messages) if self.tracing.enabled else 0,
                )
        except BaseException:
            if oversize:
                self.oversize.release(self.owner)
            if probe:
                self.breaker.record(unavailable=True, reason=self.breaker.reason, probe=True)
            raise
        batch = Batch(claim.messages, claimed_at=started, probe=probe, ahead=budget is not None)
        if oversize:
            if batch.payload_bytes > self.config.batch_bytes:
                batch.oversize = True  # the turn stays with the batch until it is finalized
            else:
                self.oversize.release(self.owner)  # not needed after all: another worker may have it
        self.metrics.observe_claim(time.monotonic() - started)
        leased = len(claim.messages) + len(claim.unreadable)
        self._saturated = leased >= batch_size
        if not probe:
            self._batch_size = self._next_batch_size(leased, batch_size)
        if leased and self.presence is not None:
            self.presence.working(self.owner, saturated=self._saturated)
        if housekeeping:
            self._ingest_behind = claim.ingest_full
        self._report_reaped(claim.reaped)
        if claim.unreadable:
            # Rows that cannot become messages go to dead before the rest are published;
            # only they are lost to the broker, not the batch they came in.
            self.stats.claimed += len(claim.unreadable)
            for u in claim.unreadable:
                self.metrics.failure(u.message.event_type, "permanent")
            await self._finalize([Decision.dead(u.message, u.reason) for u in claim.unreadable])
        if not batch.messages and probe:  # nothing to probe with; try again after the next backoff
            self.breaker.record(unavailable=True, reason=self.breaker.reason, probe=True)
        self.stats.claimed += len(batch.messages)
        return batch, leased

    def _next_batch_size(self, leased: int, asked: int) -> int:
        """The next claim's size: twice this one's after a full claim, up to the config's
        ceiling; the configured size again after a short one."""
        ceiling = max(self.config.batch_size, self.config.max_batch_size or 0)
        if leased >= asked:
            return min(asked * 2, ceiling)
        return self.config.batch_size

    async def _publish_batch(self, batch: Batch) -> list[Decision]:
        """Publish ``batch`` and decide each message's outcome; the breaker hears the verdict."""
        try:
            return await self._publish_and_decide(batch)
        finally:
            for m in batch.messages:  # a payload spooled to a file: stored by now, or not at all
                if m.spooled is not None:
                    m.spooled.close()

    async def _publish_and_decide(self, batch: Batch) -> list[Decision]:
        await self._give_way()
        messages = batch.messages
        timeout = self._deadline(batch)
        if timeout is None:
            # Not tried, so handed back with its attempt refunded. A probe that sent
            # nothing proves nothing: the breaker stays open.
            if batch.probe:
                self.breaker.record(unavailable=True, reason=self.breaker.reason, probe=True)
            return [Decision.released(m, LEASE_RAN_OUT) for m in messages]
        # The messages sent carry their spans' traceparent; decisions are about the rows.
        sent, spans = self.tracing.begin_publish(messages)
        try:
            async with self.turns.shared():
                outcomes = await self._publish(sent, timeout)
        except BaseException as exc:  # cancelled (shutdown past its grace)
            spans.end([exc] * len(sent))
            raise
        spans.end(outcomes)
        if len(sent) > 1 and any(isinstance(o, SharedFailure) for o in outcomes):
            outcomes = await self._isolate(batch, sent, outcomes)
        # One paused destination of several (relay.routing) does not stop the claims:
        # only the broker refusing everything does.
        unavailable = [
            o for o in outcomes if isinstance(o, BrokerUnavailable) and not isinstance(o, DestinationUnavailable)
        ]
        refused_all = len(unavailable) == len(outcomes)
        if refused_all or batch.probe or self.breaker.is_open:
            self.breaker.record(
                unavailable=refused_all, reason=describe(unavailable[0]) if unavailable else "", probe=batch.probe
            )
        # How long the outage has lasted sets how far its rows are pushed back.
        failures = max(1, self.breaker.failures)
        decisions = [
            self.config.policy.decide(m, o, broker_failures=failures) for m, o in zip(messages, outcomes, strict=True)
        ]
        for m, o in zip(messages, outcomes, strict=True):
            if o is not None:
                self.metrics.failure(m.event_type, failure_class(o))
        _log_unclassified(outcomes)
        return decisions

    async def _isolate(self, batch: Batch, sent: Sequence[OutboxMessage], outcomes: Sequence[Outcome]) -> list[Outcome]:
        """Publish the messages a shared failure took down again, each alone, in order,
        while nothing else of the process publishes: their own outcomes replace the
        batch's. One with too little lease left keeps the batch's outcome."""
        suspects = sum(1 for o in outcomes if isinstance(o, SharedFailure))
        log.warning(
            "a batch failed as a whole (%s); publishing its %d messages apart to find the cause",
            first_line(next(o for o in outcomes if isinstance(o, SharedFailure))),
            suspects,
        )
        found = list(outcomes)
        async with self.turns.exclusive():
            for i, (m, o) in enumerate(zip(sent, outcomes, strict=True)):
                if not isinstance(o, SharedFailure):
                    continue
                timeout = self._deadline(batch)
                if timeout is None:
                    break
                [found[i]] = await self._publish([m], timeout)
        self.stats.isolated += suspects
        return found

    def _report_reaped(self, reaped: Sequence[Reaped]) -> None:
        for row in reaped:
            fields = log_fields(row.id, row.aggregate_id, row.event_type, row.lease_version)
            if row.status == "dead":
                self.stats.reaped += 1
                self.metrics.reaped()
                self.metrics.messages(row.event_type, "dead")
                self.metrics.failure(row.event_type, "lease_expired")
                log.warning("lease expired on the last attempt; message sent to dead", extra=fields)
            else:
                log.info("lease expired; message returned to pending", extra=fields)

    def _deadline(self, batch: Batch) -> float | None:
        """Seconds ``batch`` may publish for: the publish timeout, and in any case no longer
        than its lease lasts (with the margin), counted from its own claim: a publish still
        running when its lease expires could land after the new owner's.

        None: do not start. No time is left; or the batch was claimed ahead and has less
        than half of the time an unpipelined batch would get (it waited behind a slow
        publish): it would likely time out, a duplicate and an attempt spent, where a
        fresh claim of its rows gets the whole deadline."""
        usable = self.config.lease - self.config.lease_margin
        left = (usable - timedelta(seconds=time.monotonic() - batch.claimed_at)).total_seconds()
        full = min(self.config.publish_timeout, usable).total_seconds()
        if left <= 0 or (batch.ahead and left < full * MIN_DEADLINE_SHARE):
            return None
        return min(full, left)

    async def _publish(self, messages: Sequence[OutboxMessage], deadline_s: float) -> list[Outcome]:
        """Publish within ``deadline_s`` seconds; one outcome per message, whatever happens."""
        started = time.monotonic()
        try:
            if self.claim_check is not None:
                return await self.claim_check.publish(self.publisher, messages, deadline_s, self.store.record_payloads)
            return await publish_within(self.publisher, messages, deadline_s)
        finally:
            self.metrics.observe_publish(time.monotonic() - started)

    async def _finalize(self, decisions: Sequence[Decision]) -> None:
        """Write the decisions; if the database is unreachable, keep trying for as long as
        the lease lasts (fencing makes a late write safe). Past that the rows return to
        'pending' through their expired leases, and the messages are sent again."""
        await self._give_way()
        give_up = time.monotonic() + self.config.lease.total_seconds()
        failures = 0
        while True:
            try:
                refused = await self.store.finalize(decisions)
                break
            except TRANSIENT_DB_ERRORS as exc:
                failures += 1
                if time.monotonic() >= give_up:
                    log.error(
                        "could not record %d outcomes before the lease ran out; the rows return after it: %s",
                        len(decisions),
                        first_line(exc),
                    )
                    raise
                delay = self.config.db_backoff.delay(failures).total_seconds()
                log.warning("finalize failed, retrying in %.1fs: %s", delay, first_line(exc))
                await asyncio.sleep(delay)
        if failures:
            log.info("finalize recorded after %d retries", failures)
        # Counted by (event type, kind), one metrics call each: a batch is mostly one or two.
        counts: dict[tuple[str, Kind], int] = {}
        for d in decisions:
            if refused and d.message.id in refused:
                self.stats.lost_leases += 1
                self.metrics.lost_lease()
                log.warning(
                    "lost lease: finalize refused, the row belongs to a newer claim",
                    extra={**d.message.log_fields(), "outcome": d.kind},
                )
                continue
            key = (d.message.event_type, d.kind)
            counts[key] = counts.get(key, 0) + 1
            if d.kind == "published":
                continue
            if d.kind == "dead":
                log.error("message sent to dead: %s", d.error, extra=d.message.log_fields())
            elif d.kind == "retried":
                log.info("message rescheduled in %.1fs: %s", d.delay_s, d.error, extra=d.message.log_fields())
            elif d.kind == "deferred":
                log.info("message deferred for %.1fs: %s", d.delay_s, d.error, extra=d.message.log_fields())
        for (event_type, kind), n in counts.items():
            # WorkerStats has one counter per Decision kind, named as the kind.
            setattr(self.stats, kind, getattr(self.stats, kind) + n)
            self.metrics.messages(event_type, kind, n)


async def to_the_end(work: Awaitable[T]) -> T:
    """``work``'s result, ``work`` run to its end even when the caller is cancelled meanwhile;
    the cancel is raised once it has ended. For the writes that record what the broker has
    or hand rows back: a plain ``asyncio.shield`` would let the worker end while the write
    still runs, and the runner closes the pool once every worker has ended."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the work itself was cancelled, not the caller
                raise
            cancelled = True
        except BaseException:
            break  # the work failed: its exception is raised below
    if cancelled:
        # The cancel wins over what the work raised (retrieved, so asyncio does not warn):
        # a worker told to end must end, not retry a failed write.
        if not task.cancelled():
            task.exception()
        raise asyncio.CancelledError
    return task.result()


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
