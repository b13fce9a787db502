"""The headline figures of one outbox (how much waits, how old the oldest is, what is
dead or blocked): what the metrics' gauges, the console's chart and `relay status` read.

Every figure comes from the partial indexes of unfinished rows, so a table holding
millions of done rows answers as fast as an empty one. The done count is the only figure
not counted: it is the statistics system's live-row estimate minus the exact unfinished
counts, and is labelled as an estimate wherever it is shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from relay.db import readmodel
from relay.db.names import OutboxNames
from relay.db.readmodel import SummaryRow
from relay.db.rows import Conn


@dataclass(frozen=True)
class StatusSummary:
    """The headline figures of one outbox; ages are seconds by the database clock."""

    at: datetime
    pending_unordered: int
    pending_ordered: int
    processing: int
    expired_leases: int
    dead: int
    oldest_waiting_age_s: float | None  # oldest pending or processing message; None when none waits
    oldest_dead_age_s: float | None
    blocked_aggregates: int  # ordered aggregates whose head message is dead
    oldest_blocked_age_s: float | None  # age of the oldest dead head
    waiting_behind_blocked: int  # ordered messages queued behind those dead heads
    done_estimate: int | None  # an estimate, never a count: see the module docstring
    total_bytes: int | None  # table, indexes and TOAST

    @property
    def pending(self) -> int:
        return self.pending_unordered + self.pending_ordered

    @property
    def awaiting(self) -> int:
        """Messages not yet delivered and not given up on: pending plus processing."""
        return self.pending + self.processing


def age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max((now - then).total_seconds(), 0.0)


def summarize(r: SummaryRow) -> StatusSummary:
    """The headline figures of a ``status_summary`` row: ages by its clock, done estimated."""
    unfinished = r.pending_unordered + r.pending_ordered + r.processing + r.dead
    return StatusSummary(
        at=r.now,
        pending_unordered=r.pending_unordered,
        pending_ordered=r.pending_ordered,
        processing=r.processing,
        expired_leases=r.expired_leases,
        dead=r.dead,
        oldest_waiting_age_s=age(r.now, r.oldest_waiting_at),
        oldest_dead_age_s=age(r.now, r.oldest_dead_at),
        blocked_aggregates=r.blocked_aggregates,
        oldest_blocked_age_s=age(r.now, r.oldest_blocked_at),
        waiting_behind_blocked=r.waiting_behind_blocked,
        done_estimate=None if r.live_estimate is None else max(r.live_estimate - unfinished, 0),
        total_bytes=r.total_bytes,
    )


async def read_summary(conn: Conn, names: OutboxNames) -> StatusSummary:
    """The headline figures; also what :meth:`relay.metrics.RelayMetrics.refresh_gauges` reads."""
    return summarize(await readmodel.status_summary(conn, names))
