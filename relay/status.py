"""`relay status`: is the relay keeping up? Counts, ages and blocked aggregates of one outbox.

Every figure comes from the partial indexes of unfinished rows (see ``sql/ops.sql``), so a
table holding millions of done rows answers as fast as an empty one. The done count is
the only figure not counted: it is the statistics system's live-row estimate minus the
exact unfinished counts, and is labelled as an estimate wherever it is shown.

This module also holds :func:`ops_query`, through which every operator tool reads its
named statements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from relay.durations import format_duration
from relay.shared_settings import SharedSettings, read_settings
from relay.sqlfiles import named_queries
from relay.sqlnames import OutboxNames
from relay.textsafe import printable

Conn = psycopg.AsyncConnection[Any]

# Histogram buckets of attempts used so far: exact for the first few (the usual retries),
# then doubling, so a long tail of poison messages stays on one screen.
ATTEMPT_BUCKETS: tuple[tuple[int, int | None], ...] = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))


@cache
def ops_query(names: OutboxNames, name: str) -> sql.Composed:
    """The named statement ``name`` of ``sql/*.sql`` rendered for ``names``, once per process."""
    return names.render(named_queries()[name])


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


@dataclass(frozen=True)
class EventTypeStatus:
    """Unfinished rows of one event type."""

    event_type: str
    pending: int
    processing: int
    expired_leases: int
    dead: int
    oldest_waiting_age_s: float | None


@dataclass(frozen=True)
class WakeupStatus:
    """Who producers would wake: relay processes listening, and whether they notify now."""

    listening: int  # relay processes whose row in <table>_listeners has not expired
    idle: int  # of those, the ones waiting for a wake-up
    producers_notify: bool  # every one of them idle (and notify on): inserts send NOTIFY


@dataclass(frozen=True)
class Status:
    """Everything `relay status` shows."""

    summary: StatusSummary
    attempts: Mapping[int, int]  # attempts used so far -> messages awaiting delivery
    by_event_type: tuple[EventTypeStatus, ...] | None  # None unless asked for
    settings: SharedSettings | None = None  # the stored ordering map and notify
    wakeups: WakeupStatus | None = None


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max((now - then).total_seconds(), 0.0)


async def read_summary(conn: Conn, names: OutboxNames) -> StatusSummary:
    """The headline figures; also what :meth:`relay.metrics.RelayMetrics.refresh_gauges` reads."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(ops_query(names, "status_summary"), {"schema": names.schema, "table": names.table})
    r = await cur.fetchone()
    if r is None:  # an aggregate-only SELECT always returns a row
        raise RuntimeError("status_summary returned no row")
    now = r["now"]
    unfinished = r["pending_unordered"] + r["pending_ordered"] + r["processing"] + r["dead"]
    live = r["live_estimate"]
    return StatusSummary(
        at=now,
        pending_unordered=r["pending_unordered"],
        pending_ordered=r["pending_ordered"],
        processing=r["processing"],
        expired_leases=r["expired_leases"],
        dead=r["dead"],
        oldest_waiting_age_s=_age(now, r["oldest_waiting_at"]),
        oldest_dead_age_s=_age(now, r["oldest_dead_at"]),
        blocked_aggregates=r["blocked_aggregates"],
        oldest_blocked_age_s=_age(now, r["oldest_blocked_at"]),
        waiting_behind_blocked=int(r["waiting_behind_blocked"]),
        done_estimate=None if live is None else max(int(live) - unfinished, 0),
        total_bytes=r["total_bytes"],
    )


async def read_status(conn: Conn, names: OutboxNames, *, by_event_type: bool = False) -> Status:
    """The summary, the attempts histogram and, if asked, the breakdown by event type."""
    summary = await read_summary(conn, names)
    cur = await conn.execute(ops_query(names, "status_attempts"))
    attempts = {int(a): int(n) for a, n in await cur.fetchall()}
    breakdown: tuple[EventTypeStatus, ...] | None = None
    if by_event_type:
        cur = await conn.execute(ops_query(names, "status_by_event_type"))
        breakdown = _by_event_type(summary.at, await cur.fetchall())
    settings = await read_settings(conn, names)
    cur = await conn.execute(ops_query(names, "status_wakeups"))
    row = await cur.fetchone()
    wakeups = WakeupStatus(int(row[0]), int(row[1]), bool(row[2])) if row else None
    return Status(summary=summary, attempts=attempts, by_event_type=breakdown, settings=settings, wakeups=wakeups)


def _by_event_type(now: datetime, rows: Sequence[tuple[Any, ...]]) -> tuple[EventTypeStatus, ...]:
    acc: dict[str, dict[str, Any]] = {}
    for event_type, status, n, oldest, expired in rows:
        entry = acc.setdefault(
            event_type, {"pending": 0, "processing": 0, "expired_leases": 0, "dead": 0, "oldest": None}
        )
        entry[status] = int(n)
        entry["expired_leases"] += int(expired)
        if status in ("pending", "processing") and (entry["oldest"] is None or oldest < entry["oldest"]):
            entry["oldest"] = oldest
    return tuple(
        EventTypeStatus(
            event_type=event_type,
            pending=e["pending"],
            processing=e["processing"],
            expired_leases=e["expired_leases"],
            dead=e["dead"],
            oldest_waiting_age_s=_age(now, e["oldest"]),
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


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses as dicts and datetimes as ISO 8601 text, ready for json.dumps."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def to_json(status: Status) -> dict[str, Any]:
    """A JSON-ready dict of ``status`` (ages in seconds, times ISO 8601)."""
    out: dict[str, Any] = jsonable(status)
    out["summary"]["pending"] = status.summary.pending
    out["summary"]["awaiting"] = status.summary.awaiting
    if status.by_event_type is None:
        del out["by_event_type"]
    out["settings"] = status.settings.to_json() if status.settings else None
    return out


def age_text(seconds: float | None) -> str:
    """``3m12s``-style age, or ``-`` when there is nothing to age."""
    return "-" if seconds is None else format_duration(timedelta(seconds=seconds))


def _bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def render_text(status: Status, names: OutboxNames, where: str) -> str:
    """The human view of ``status``; ``where`` names the database (never with a password)."""
    s = status.summary
    lines = [
        f"outbox {names.qualified} on {where}, at {s.at.isoformat(timespec='seconds')} (database clock)",
        "",
        f"  pending        {s.pending:>10,}   ordered {s.pending_ordered:,}, unordered {s.pending_unordered:,}",
        f"  processing     {s.processing:>10,}   expired leases {s.expired_leases:,}",
        f"  dead           {s.dead:>10,}   oldest {age_text(s.oldest_dead_age_s)}",
        "  done (est.)    "
        + (f"{'~' + format(s.done_estimate, ','):>10}" if s.done_estimate is not None else f"{'unknown':>10}")
        + "   estimate from table statistics, not a count",
        f"  table size     {_bytes(s.total_bytes):>10}   with indexes",
        "",
        f"  oldest awaiting delivery  {age_text(s.oldest_waiting_age_s)}   (pending or processing)",
        f"  blocked aggregates        {s.blocked_aggregates:,}"
        + (
            f"   oldest dead head {age_text(s.oldest_blocked_age_s)}, {s.waiting_behind_blocked:,} messages wait"
            " behind them (`relay dead list`)"
            if s.blocked_aggregates
            else ""
        ),
        "",
        "  attempts used by messages awaiting delivery",
    ]
    histogram = attempt_histogram(status.attempts)
    widest = max((n for _, n in histogram), default=0)
    for label, n in histogram:
        bar = "#" * (round(30 * n / widest) if widest else 0)
        lines.append(f"    {label:>5}  {n:>10,}  {bar}".rstrip())
    if status.settings is not None:
        o = status.settings.ordering
        lines += [
            "",
            "  shared settings (`relay settings show`, changed by `relay settings set`)",
            f"    ordering  default {status.settings.value('ordering_default')}, ordered {list(o.ordered)},"
            f" unordered {list(o.unordered)}",
            f"    notify    {'true' if status.settings.notify else 'false (producers send no wake-ups; relays poll)'}",
        ]
    if status.wakeups is not None:
        lines.append(f"  wake-ups       {_wakeups_text(status.wakeups)}")
    if status.by_event_type is not None:
        lines += ["", _event_type_table(status.by_event_type)]
    return "\n".join(lines)


def _wakeups_text(w: WakeupStatus) -> str:
    if not w.listening:
        return "no relay listening (relays that run poll, or none runs)"
    relays = f"{w.listening} relay process{'es' if w.listening != 1 else ''} listening, {w.idle} idle"
    if w.producers_notify:
        return f"{relays}: producers' inserts wake them"
    if w.idle < w.listening:
        return f"{relays}: producers send no wake-ups (a working relay claims new rows itself)"
    # All idle and still no wake-ups: the stored notify is off, or the answer in the settings
    # row lapsed (an idle relay killed, another not renewed yet; relays older than 0008).
    return f"{relays}: producers send no wake-ups (notify is off, or the relays' answer has lapsed)"


def _event_type_table(rows: Sequence[EventTypeStatus]) -> str:
    if not rows:
        return "  no unfinished messages of any event type"
    # Event types are producer data: escaped, so a newline in one cannot start a row, and
    # cut, so one 70,000-character type does not widen the whole table.
    shown = [printable(r.event_type) for r in rows]
    width = max(10, *(len(t) for t in shown))
    head = f"  {'EVENT TYPE':<{width}}  {'PENDING':>9}  {'PROCESSING':>10}  {'EXPIRED':>7}  {'DEAD':>7}  OLDEST WAITING"
    body = [
        f"  {t:<{width}}  {r.pending:>9,}  {r.processing:>10,}  {r.expired_leases:>7,}  {r.dead:>7,}  "
        f"{age_text(r.oldest_waiting_age_s)}"
        for t, r in zip(shown, rows, strict=True)
    ]
    return "\n".join([head, *body])
