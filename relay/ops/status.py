"""`relay status`: is the relay keeping up? Counts, ages and blocked aggregates of one outbox.

Every figure comes from the partial indexes of unfinished rows (see ``sql/ops.sql``), so a
table holding millions of done rows answers as fast as an empty one. The done count is
the only figure not counted: it is the statistics system's live-row estimate minus the
exact unfinished counts, and is labelled as an estimate wherever it is shown.

The figures are read by :mod:`relay.db.readmodel`; this module turns its rows into ages
and totals, and :mod:`relay.ops.render` shows them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from relay.db import readmodel
from relay.db.names import OutboxNames
from relay.db.readmodel import Conn, EventTypeRow, WakeupStatus
from relay.db.settings import SharedSettings, read_settings
from relay.summary import StatusSummary, age, read_summary

# Histogram buckets of attempts used so far: exact for the first few (the usual retries),
# then doubling, so a long tail of poison messages stays on one screen.
ATTEMPT_BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))


@dataclass(frozen=True)
class EventTypeStatus:
    """Unfinished rows of one event type."""

    event_type: str
    pending: int
    processing: int
    expired_leases: int
    dead: int
    oldest_waiting_age_s: float | None
    # Where this type is delivered under the routes of the config the command was given;
    # None when it was given no broker.
    destination: str | None = None


@dataclass(frozen=True)
class Status:
    """Everything `relay status` shows."""

    summary: StatusSummary
    attempts: Mapping[int, int]  # attempts used so far -> messages awaiting delivery
    by_event_type: tuple[EventTypeStatus, ...] | None  # None unless asked for
    settings: SharedSettings | None = None  # the stored ordering map and notify
    wakeups: WakeupStatus | None = None


async def read_status(
    conn: Conn,
    names: OutboxNames,
    *,
    by_event_type: bool = False,
    destination_of: Callable[[str], str] | None = None,
) -> Status:
    """The summary, the attempts histogram and, if asked, the breakdown by event type (with
    each type's destination when ``destination_of`` says it)."""
    summary = await read_summary(conn, names)
    attempts = await readmodel.status_attempts(conn, names)
    breakdown: tuple[EventTypeStatus, ...] | None = None
    if by_event_type:
        breakdown = by_event_type_status(summary.at, await readmodel.status_by_event_type(conn, names))
        if destination_of is not None:
            breakdown = tuple(replace(t, destination=destination_of(t.event_type)) for t in breakdown)
    settings = await read_settings(conn, names)
    wakeups = await readmodel.status_wakeups(conn, names)
    return Status(summary=summary, attempts=attempts, by_event_type=breakdown, settings=settings, wakeups=wakeups)


def by_event_type_status(now: datetime, rows: Sequence[EventTypeRow]) -> tuple[EventTypeStatus, ...]:
    """One :class:`EventTypeStatus` per event type of ``rows`` (one row per type and status),
    sorted by event type; the oldest waiting is the oldest pending or processing row."""
    acc: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = acc.setdefault(
            row.event_type, {"pending": 0, "processing": 0, "expired_leases": 0, "dead": 0, "oldest": None}
        )
        entry[row.status] = row.n
        entry["expired_leases"] += row.expired
        if row.status in ("pending", "processing") and (entry["oldest"] is None or row.oldest < entry["oldest"]):
            entry["oldest"] = row.oldest
    return tuple(
        EventTypeStatus(
            event_type=event_type,
            pending=e["pending"],
            processing=e["processing"],
            expired_leases=e["expired_leases"],
            dead=e["dead"],
            oldest_waiting_age_s=age(now, e["oldest"]),
        )
        for event_type, e in sorted(acc.items())
    )


def attempt_histogram(attempts: Mapping[int, int]) -> list[tuple[str, int]]:
    """``attempts`` folded into :data:`ATTEMPT_BUCKETS` as ``(label, count)``."""
    out = []
    for low, high in ATTEMPT_BUCKETS:
        n = sum(c for a, c in attempts.items() if a >= low and (high is None or a <= high))
        label = f"{low}+" if high is None else (str(low) if low == high else f"{low}-{high}")
        out.append((label, n))
    return out
