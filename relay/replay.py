"""`relay replay`: finished outbox rows published again, to the same destinations or to
another one (a new consumer's own queue), without changing a row.

A replay reads; it never writes the outbox, takes no row lock and holds no transaction
open while it publishes, so live relays go on as if it were not there. It works from a
*plan* taken once at the start (``sql/replay.sql``): the rows selected, in replay order
(per aggregate the order they were delivered in), kept in a temporary table of the
replay's own session. Because it keeps no state in the outbox, an interrupted replay is
resumed by running it again from an id (``--from-id``) that :class:`Replayer` computes:
every selected row below it has been confirmed by the broker.

Publishing follows the live relay's rules where they apply: the broker adapters and
their failure classes, at most one ordered message per aggregate in a batch, and an
aggregate's next message only once the one before is confirmed (so aggregates go in
parallel and each one in order). Where a live message would go to dead, a replayed one
is reported as not replayed, and the rest of its aggregate is held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from relay.backoff import Backoff
from relay.claimcheck import ClaimChecks, ClaimCheckStore
from relay.contract import Outcome, Publisher, publish_within
from relay.db.dispatch import Unreadable
from relay.db.replay import PlanRow, PlanSummary, ReplayPlan
from relay.decide import describe, describe_text
from relay.dsn import mask
from relay.errors import (
    BrokerUnavailable,
    ConfigError,
    Defer,
    DestinationUnavailable,
    NoRoomForReplayMarker,
    PermanentError,
    RetryableError,
    first_line,
    shown,
)
from relay.message import OutboxMessage
from relay.ordering import names_and_patterns
from relay.tracing import NO_TRACING, Tracing

log = logging.getLogger("relay.replay")

MAX_ID = 2**63 - 1
# --exclude takes ids by hand (or from a printed resume command); a selection that would
# need more is narrowed another way, or run with --skip-failed.
MAX_EXCLUDED = 10_000
# A run id is a header value and part of an SQS/SNS FIFO de-duplication id (at most 128
# characters of letters, digits and punctuation, with the outbox id in front).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
# While the broker refuses everything, a replay probes this often (as the live relay does).
OUTAGE_BACKOFF = Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=5))
# Rows read ahead of the publishers: enough to keep every worker's batches full across
# many aggregates, few enough that a page of large payloads stays a bounded amount.
READ_AHEAD_BATCHES = 4


def new_run_id(now: datetime | None = None) -> str:
    """A run id that sorts by time and cannot collide: ``20261201T201500Z-3f9a1c``."""
    moment = (now or datetime.now(UTC)).astimezone(UTC)
    return f"{moment:%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


def check_run_id(value: str) -> str:
    if not RUN_ID.fullmatch(value):
        raise ConfigError(
            f"invalid --run-id {shown(value)}: 1 to 64 letters, digits and _ . : - (starting with a letter or digit)"
        )
    return value


@dataclass(frozen=True)
class Selection:
    """Which finished rows a replay publishes. Every selector narrows it; one at least is
    required (:meth:`check`), so that nobody replays a whole outbox by leaving one out."""

    from_id: int | None = None
    to_id: int | None = None
    since: datetime | None = None  # created_at at or after
    until: datetime | None = None  # created_at before
    aggregates: tuple[str, ...] = ()
    event_types: tuple[str, ...] = ()  # names or globs, as the ordering rules read them
    include_dead: bool = False
    # Rows an operator skipped (relay dead skip, relay prune --skip-blocking) were never
    # delivered and someone decided they must not be: left out unless asked for.
    include_skipped: bool = False
    excluded: tuple[int, ...] = ()  # ids never replayed (--exclude), whatever else selects them

    def check(self) -> Selection:
        """This selection, or :class:`relay.ConfigError` (one line) for one that selects
        nothing at all, or a range that is empty or malformed."""
        if not (
            self.from_id is not None
            or self.to_id is not None
            or self.since
            or self.until
            or self.aggregates
            or self.event_types
        ):
            raise ConfigError(
                "say which messages to replay: --from-id, --to-id, --since, --until, --aggregate or --event-type"
                " (at least one)"
            )
        if self.from_id is not None and self.to_id is not None and self.from_id > self.to_id:
            raise ConfigError(f"--from-id {self.from_id} is above --to-id {self.to_id}: nothing could match")
        if self.since and self.until and self.since >= self.until:
            raise ConfigError("--since and --until leave no time between them: nothing could match")
        for what, values in (("--aggregate", self.aggregates), ("--event-type", self.event_types)):
            if any(not v.strip() for v in values):
                raise ConfigError(f"invalid {what}: must not be empty")
        if len(self.excluded) > MAX_EXCLUDED:
            raise ConfigError(
                f"too many ids to --exclude ({len(self.excluded):,}; at most {MAX_EXCLUDED:,}):"
                " narrow the selection, or let --skip-failed leave out what fails"
            )
        return self

    @property
    def histories(self) -> list[str]:
        """What a selected row's history (the SQL function <table>_history) must be."""
        return ["delivered", *(["skipped"] if self.include_skipped else []), *(["dead"] if self.include_dead else [])]

    def params(self) -> dict[str, Any]:
        """The plan statement's parameters for this selection."""
        names, patterns = names_and_patterns(self.event_types)
        return {
            "from_id": 0 if self.from_id is None else self.from_id,
            "to_id": MAX_ID if self.to_id is None else self.to_id,
            "histories": self.histories,
            "excluded": sorted(set(self.excluded)),
            "since": self.since,
            "until": self.until,
            "aggregates": list(self.aggregates) or None,
            "event_names": names if self.event_types else None,
            "event_patterns": patterns,
        }


@dataclass(frozen=True)
class ReplayLimits:
    """How hard a replay pushes: the live relay's settings of the same names."""

    workers: int = 4
    batch_size: int = 100
    batch_bytes: int = 4 * 1024 * 1024
    publish_timeout: timedelta = timedelta(seconds=20)
    max_attempts: int = 12
    backoff: Backoff = field(default_factory=lambda: Backoff(base=timedelta(seconds=1), cap=timedelta(minutes=5)))
    rate: float | None = None  # messages per second at most; None: as fast as the broker confirms
    # --claim-check-bucket: large payloads sent as references, as the live relay sends them
    # (the same objects: keyed by the event id).
    claim_check: ClaimChecks | None = None


@dataclass
class ReplayReport:
    """What a replay did; its figures grow while it runs (the progress line reads them)."""

    run_id: str
    total: int
    published: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)  # (outbox id, why) not replayed
    # Of those, the ids whose failure no later run can change as things are (the broker
    # refuses the message itself), and those that fit live but not with the replay marker.
    permanent: list[int] = field(default_factory=list)
    no_room_for_marker: list[int] = field(default_factory=list)
    held_back: int = 0  # behind a failed message of their aggregate, not sent
    gone: int = 0  # pruned, or no longer finished, since the plan was taken
    interrupted: bool = False
    # The failed messages were left out and their aggregates went on (--skip-failed): the
    # replay is complete without them.
    failed_left_out: bool = False
    lost_database: str | None = None  # why reading the plan failed midway, if it did
    resume_from: int | None = None  # --from-id of a run that does the rest; None: nothing left
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def settled(self) -> int:
        return self.published + len(self.failed) + self.held_back + self.gone

    @property
    def complete(self) -> bool:
        failed = bool(self.failed) and not self.failed_left_out
        return not self.interrupted and not self.lost_database and not failed and not self.held_back


class RatePacer:
    """At most ``rate`` messages per second on average, one batch at a time: each batch
    waits for its turn, which the batches before it pushed back by their size."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self._next = clock()

    def delay(self, n: int) -> float:
        """Reserve ``n`` messages' worth of time; how long to wait before sending them."""
        now = self.clock()
        start = max(now, self._next)
        self._next = start + n / self.rate
        return start - now


@dataclass(slots=True)
class _Item:
    rank: int
    resume_from: int
    message: OutboxMessage
    lane: str | None  # the aggregate an ordered message waits in; None: it waits for nobody
    tries: int = 0  # retryable failures so far
    outages: int = 0  # broker-unavailable answers in a row

    def __lt__(self, other: _Item) -> bool:
        return self.rank < other.rank


class Replayer:
    """Publishes one plan. Aggregates go in parallel, each in plan order: an ordered
    message is handed to a worker only once the message before it in its aggregate is
    confirmed; unordered ones wait for nobody. ``progress`` is called with the report as
    it changes."""

    def __init__(
        self,
        plan: ReplayPlan,
        publisher: Publisher,
        run_id: str,
        limits: ReplayLimits,
        *,
        progress: Callable[[ReplayReport], None] | None = None,
        tracing: Tracing = NO_TRACING,
        skip_failed: bool = False,
    ) -> None:
        """``skip_failed``: a message that cannot be replayed is left out and the rest of its
        aggregate goes on (by default the aggregate stops there, as a dead head stops it live)."""
        self.plan = plan
        self.skip_failed = skip_failed
        self.publisher = publisher
        self.run_id = run_id
        self.limits = limits
        self.claim_check = None if limits.claim_check is None else ClaimCheckStore(limits.claim_check)
        self.progress = progress or (lambda report: None)
        # Spans as the live relay makes them (relay start --otel), marked as this replay's.
        self.tracing = tracing
        self.pacer = RatePacer(limits.rate) if limits.rate else None
        self._changed = asyncio.Condition()
        self._ready: list[_Item] = []  # heap by rank: publishable now
        self._later: list[tuple[float, _Item]] = []  # heap by due time: waiting to retry
        self._behind: dict[str, deque[_Item]] = {}  # per aggregate, what waits behind its current one
        self._current: set[str] = set()  # aggregates with a message ready, out or waiting to retry
        self._blocked: set[str] = set()  # aggregates stopped by a message that failed
        self._finished: set[int] = set()  # ranks confirmed (or gone) above the low-water mark
        self._low = 1  # the lowest rank not confirmed: everything below it is
        self._buffered = 0  # items read and not settled
        self._out = 0  # items being published
        self._read_all = False
        # Resume points of the ranks read and not confirmed, and of the last rank read: the
        # resume is computed from these when the plan can no longer be asked (resume_from
        # never decreases with the rank, so a lower rank's is always safe).
        self._resume_of: dict[int, int] = {}
        self._last_read_resume: int | None = None
        self._last_outage_log = float("-inf")
        self.report = ReplayReport(run_id=run_id, total=0)

    async def run(self, total: int, stop: asyncio.Event, *, first_id: int | None = None) -> ReplayReport:
        """Publish the plan's ``total`` rows until done or ``stop``; ``first_id``, its
        lowest id, is where a resume starts if the database is lost before a row is read."""
        report = self.report = ReplayReport(run_id=self.run_id, total=total, failed_left_out=self.skip_failed)
        watcher = asyncio.create_task(self._watch(stop))
        try:
            tasks = [asyncio.create_task(self._read(stop))]
            tasks += [asyncio.create_task(self._work(stop)) for _ in range(self.limits.workers)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            watcher.cancel()
        report.interrupted = stop.is_set() and self._low <= total
        if self._low <= total:
            report.resume_from = await self._resume_point(first_id)
        report.finished = time.monotonic()
        self.progress(report)
        return report

    async def _resume_point(self, first_id: int | None) -> int | None:
        """The --from-id that covers every rank from the low-water mark on: the plan's
        answer, or, when the database cannot be asked, the safe one read already."""
        if self.report.lost_database is None:
            try:
                return await self.plan.resume_from(self._low)
            except psycopg.Error as exc:
                self.report.lost_database = mask(first_line(exc))
        if self._low in self._resume_of:
            return self._resume_of[self._low]
        return self._last_read_resume if self._last_read_resume is not None else first_id

    # ---- reading the plan

    async def _read(self, stop: asyncio.Event) -> None:
        window = self.limits.batch_size * self.limits.workers * READ_AHEAD_BATCHES
        after = 0
        while not stop.is_set():
            async with self._changed:
                await self._changed.wait_for(lambda: stop.is_set() or self._buffered < window // 2)
            if stop.is_set():
                return
            try:
                rows = await self.plan.page(
                    after, window - self._buffered, self.limits.batch_bytes * READ_AHEAD_BATCHES
                )
            except psycopg.Error as exc:
                # The plan lived in that session: what is out is finished, and the report
                # says where a new replay takes over.
                log.error("replay: reading the plan failed, stopping: %s", mask(first_line(exc)))
                async with self._changed:
                    self.report.lost_database = mask(first_line(exc))
                    self._changed.notify_all()
                return
            if not rows:
                break
            after = rows[-1].rank
            async with self._changed:
                for row in rows:
                    self._admit(row)
                self._changed.notify_all()
            self.progress(self.report)
        async with self._changed:
            self._read_all = True
            self._changed.notify_all()

    def _admit(self, row: PlanRow) -> None:
        self._last_read_resume = row.resume_from
        if row.message is None:
            self.report.gone += 1
            self._confirm(row.rank)
            return
        if isinstance(row.message, Unreadable):
            m = row.message.message
            self._resume_of[row.rank] = row.resume_from
            self._fail(_Item(row.rank, row.resume_from, m, _lane(m)), row.message.reason, in_lane=False)
            return
        message = replace(row.message, replay=self.run_id)
        item = _Item(row.rank, row.resume_from, message, _lane(message))
        self._resume_of[row.rank] = row.resume_from
        self._buffered += 1
        lane = item.lane
        if lane is None:
            heapq.heappush(self._ready, item)
        elif lane in self._blocked:
            self.report.held_back += 1
        elif lane in self._current:
            self._behind.setdefault(lane, deque()).append(item)
        else:
            self._current.add(lane)
            heapq.heappush(self._ready, item)

    # ---- publishing

    async def _work(self, stop: asyncio.Event) -> None:
        while True:
            batch = await self._next_batch(stop)
            if not batch:
                return
            try:
                if self.pacer is not None:
                    wait = self.pacer.delay(len(batch))
                    if wait > 0 and await _stopped_within(stop, wait):
                        return  # taken and not sent: they stay above the low-water mark
                messages = [item.message for item in batch]
                sent, spans = self.tracing.begin_publish(messages, attributes={"outbox.replay": self.run_id})
                try:
                    timeout = self.limits.publish_timeout.total_seconds()
                    if self.claim_check is not None:
                        outcomes = await self.claim_check.publish(
                            self.publisher, sent, timeout, self.plan.record_payloads
                        )
                    else:
                        outcomes = await publish_within(self.publisher, sent, timeout)
                except BaseException as exc:  # cancelled
                    spans.end([exc] * len(sent))
                    raise
                spans.end(outcomes)
            finally:
                async with self._changed:
                    self._out -= len(batch)
            async with self._changed:
                for item, outcome in zip(batch, outcomes, strict=True):
                    self._settle(item, outcome)
                self._changed.notify_all()
            self.progress(self.report)

    async def _next_batch(self, stop: asyncio.Event) -> list[_Item]:
        """The next batch to publish, once there is one; empty when the replay is over
        (everything settled, or told to stop)."""
        async with self._changed:
            while True:
                if stop.is_set() or self._is_done() or self.report.lost_database:
                    self._changed.notify_all()
                    return []
                batch = self._take()
                if batch:
                    self._out += len(batch)
                    return batch
                # Nothing ready: wait for a change, or for the first retry to fall due.
                timeout = max(self._later[0][0] - time.monotonic(), 0.0) if self._later else None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout)

    def _is_done(self) -> bool:
        return self._read_all and not self._ready and not self._later and self._out == 0

    def _take(self) -> list[_Item]:
        now = time.monotonic()
        while self._later and self._later[0][0] <= now:
            heapq.heappush(self._ready, heapq.heappop(self._later)[1])
        batch: list[_Item] = []
        size = 0
        while self._ready and len(batch) < self.limits.batch_size:
            body = self._ready[0].message.body_size
            if batch and size + body > self.limits.batch_bytes:
                break
            batch.append(heapq.heappop(self._ready))
            size += body
        return batch

    def _settle(self, item: _Item, outcome: Outcome) -> None:
        if outcome is None:
            self.report.published += 1
            self._buffered -= 1
            self._confirm(item.rank)
            self._next_of(item.lane)
            return
        retry_in = self._retry_in(item, outcome)
        if retry_in is None:
            self._buffered -= 1
            if isinstance(outcome, PermanentError):
                self.report.permanent.append(item.message.id)
            if isinstance(outcome, NoRoomForReplayMarker):
                self.report.no_room_for_marker.append(item.message.id)
            self._fail(item, _reason(item, outcome), in_lane=True)
        else:
            heapq.heappush(self._later, (time.monotonic() + retry_in, item))

    def _retry_in(self, item: _Item, outcome: BaseException) -> float | None:
        """Seconds until ``item`` is tried again after ``outcome``; None: it has failed.
        The live relay's classes: an outage or a defer waits without spending an attempt,
        a retryable failure spends one, anything else is final."""
        if isinstance(outcome, DestinationUnavailable):
            self._log_outage(outcome)
            return outcome.retry_after.total_seconds()
        if isinstance(outcome, BrokerUnavailable):
            item.outages += 1
            self._log_outage(outcome)
            return OUTAGE_BACKOFF.delay(item.outages).total_seconds()
        item.outages = 0
        if isinstance(outcome, Defer):
            return max(outcome.delay.total_seconds(), 0.0)
        if isinstance(outcome, RetryableError):
            item.tries += 1
            if item.tries >= self.limits.max_attempts:
                return None
            return self.limits.backoff.delay(item.tries).total_seconds()
        return None

    def _log_outage(self, outcome: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_outage_log >= 10:
            self._last_outage_log = now
            log.warning("the broker refuses messages, the replay waits and tries again: %s", describe(outcome))

    def _fail(self, item: _Item, reason: str, *, in_lane: bool) -> None:
        """``item`` cannot be replayed; ``in_lane``: it was its aggregate's current message
        (published and failed), not a row that could not even be read."""
        self.report.failed.append((item.message.id, reason))
        lane = item.lane
        if self.skip_failed:
            # Left out on purpose: settled, and its aggregate goes on without it.
            log.error("message not replayed, left out (--skip-failed): %s", reason, extra=item.message.log_fields())
            self._confirm(item.rank)
            if in_lane:
                self._next_of(lane)
            return
        log.error("message not replayed: %s", reason, extra=item.message.log_fields())
        if lane is not None:
            # Its aggregate stops here, as a dead head stops it live: sending the rest
            # would deliver them out of order.
            self._blocked.add(lane)
            self._current.discard(lane)
            waiting = self._behind.pop(lane, deque())
            self._buffered -= len(waiting)
            self.report.held_back += len(waiting)

    def _next_of(self, lane: str | None) -> None:
        if lane is None:
            return
        waiting = self._behind.get(lane)
        if waiting:
            heapq.heappush(self._ready, waiting.popleft())
            if not waiting:
                del self._behind[lane]
        else:
            self._current.discard(lane)

    def _confirm(self, rank: int) -> None:
        self._resume_of.pop(rank, None)
        self._finished.add(rank)
        while self._low in self._finished:
            self._finished.remove(self._low)
            self._low += 1

    async def _watch(self, stop: asyncio.Event) -> None:
        """Wake every waiter when the replay is told to stop."""
        await stop.wait()
        async with self._changed:
            self._changed.notify_all()


def _lane(message: OutboxMessage) -> str | None:
    return message.aggregate_id if message.ordered else None


def _reason(item: _Item, outcome: BaseException) -> str:
    if isinstance(outcome, RetryableError) and item.tries >= 1:
        return f"retries exhausted after {item.tries} attempts: {describe(outcome)}"
    if not isinstance(outcome, Exception):
        return describe_text(repr(outcome))
    return describe(outcome)


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


def summary_line(summary: PlanSummary) -> str:
    """The plan in words, for the dry run and the start of a replay."""
    if not summary.count:
        return "no finished message matches the selection"
    span = ""
    if summary.first_created and summary.last_created:
        span = f", created {summary.first_created:%Y-%m-%d %H:%M:%S%z} to {summary.last_created:%Y-%m-%d %H:%M:%S%z}"
    return (
        f"{count_of(summary.count, 'message')}, ids {summary.first_id} to {summary.last_id},"
        f" {count_of(summary.aggregates, 'aggregate')}{span}, {summary.payload_bytes:,} bytes of payload"
    )


def count_of(n: int, noun: str) -> str:
    """``1 message``, ``2 messages``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
