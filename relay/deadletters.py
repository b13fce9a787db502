"""`relay dead`: list dead messages, group them by error, re-drive them or skip them.

A dead message at the head of an ordered aggregate stops that aggregate, so both writes
are built around order:

* **retry** puts the rows back to ``pending`` with their attempts reset and available now
  (one timestamp for all, so the claims take them in id order); the heads trigger makes a
  re-driven head claimable at once, and its aggregate resumes in order behind it.
* **skip** marks the rows ``done`` without delivery, recording who and why; the heads
  trigger hands the aggregate on to its next message.

Both lock the rows in id order and check every one before changing any: an unknown id or
one that is not dead refuses the whole request and nothing changes. The update itself is
fenced by ``status = 'dead'`` as well, like the relay's finalize.
"""

from __future__ import annotations

import getpass
import hashlib
import logging
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from psycopg.rows import dict_row

from relay.dsn import mask
from relay.errors import ConfigError, first_line
from relay.message import log_fields
from relay.sqlnames import OutboxNames
from relay.status import Conn, age_text, ops_query
from relay.textsafe import escape, printable

log = logging.getLogger("relay.dead")

Action = Literal["retry", "skip"]


@dataclass(frozen=True)
class DeadFilter:
    """Which dead messages to pick; every field left empty matches everything."""

    event_types: tuple[str, ...] = ()
    aggregate_id: str | None = None
    error: str | None = None  # case-insensitive substring of last_error
    created_after: datetime | None = None
    created_before: datetime | None = None

    def is_empty(self) -> bool:
        return not (self.event_types or self.aggregate_id or self.error or self.created_after or self.created_before)

    def describe(self) -> str:
        """The filter as a person would say it, for "no dead messages match ..." lines."""
        parts = []
        if self.event_types:
            parts.append("event type " + " or ".join(repr(t) for t in self.event_types))
        if self.aggregate_id is not None:
            parts.append(f"aggregate {self.aggregate_id!r}")
        if self.error is not None:
            parts.append(f"error containing {self.error!r}")
        if self.created_after is not None:
            parts.append(f"created at or after {self.created_after.isoformat(timespec='seconds')}")
        if self.created_before is not None:
            parts.append(f"created before {self.created_before.isoformat(timespec='seconds')}")
        return ", ".join(parts) if parts else "no filter"

    def params(self) -> dict[str, Any]:
        return {
            "event_types": list(self.event_types) or None,
            "aggregate_id": self.aggregate_id,
            "error": self.error,
            "created_after": self.created_after,
            "created_before": self.created_before,
        }


@dataclass(frozen=True)
class DeadMessage:
    """One dead row, as `relay dead list` shows it."""

    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int
    created_at: datetime
    last_error: str | None
    ordered: bool
    lease_version: int
    blocking: bool  # the head of its ordered aggregate: everything behind it waits
    resolution: str | None  # 'retried' when an operator re-drove it before and it died again
    resolved_by: str | None
    resolved_at: datetime | None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.last_error)

    @property
    def group(self) -> str:
        return group_key(self.last_error)


@dataclass(frozen=True)
class DeadPage:
    """The dead messages that matched, up to the limit, and how many matched in all."""

    at: datetime | None
    messages: tuple[DeadMessage, ...]
    total: int


@dataclass(frozen=True)
class DeadGroup:
    """Dead messages whose errors differ only in numbers, ids and quoted values."""

    key: str  # stable short hash of the fingerprint: `relay dead retry --group KEY`
    fingerprint: str
    count: int
    blocking: int  # how many of them hold up an ordered aggregate
    event_types: tuple[str, ...]
    first_id: int
    last_id: int
    sample_error: str | None
    ids: tuple[int, ...] = field(repr=False)


@dataclass(frozen=True)
class Touched:
    """A row a re-drive or skip changed (or, in a dry run, would change)."""

    id: int
    aggregate_id: str
    event_type: str
    lease_version: int
    ordered: bool

    def log_fields(self) -> dict[str, Any]:
        return log_fields(self.id, self.aggregate_id, self.event_type, self.lease_version)


@dataclass(frozen=True)
class Refusal:
    """An id a re-drive or skip would not touch, and why."""

    id: int
    reason: str  # "unknown id" or "not dead (status done)"


@dataclass(frozen=True)
class WriteResult:
    """What a re-drive or skip did. When anything was refused, nothing changed."""

    action: Action
    dry_run: bool
    changed: tuple[Touched, ...]  # in a dry run or a refusal: what would have changed
    refused: tuple[Refusal, ...]
    by: str
    note: str | None

    @property
    def applied(self) -> bool:
        return not self.dry_run and not self.refused


# Error-text normalisation for grouping: the parts of a message that vary per message
# (quoted values, ids, numbers) are replaced, so "order 41 is too large (262211 bytes)" and
# "order 42 is too large (300002 bytes)" fall into one group. Applied in this order:
# quoted text first (it may contain anything), then id shapes, then bare numbers.
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"'(?:[^'\\]|\\.)*'"), "'?'"),
    (re.compile(r'"(?:[^"\\]|\\.)*"'), '"?"'),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.I), "<hex>"),
    # Long hex runs (request ids, digests) that contain at least one digit: "deadbeef" the
    # word stays, "9f86d081884c7d65" goes.
    (re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b", re.I), "<hex>"),
    (re.compile(r"\d+(?:\.\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
)
FINGERPRINT_MAX = 160  # characters: enough to tell errors apart, short enough for one line


def fingerprint(error: str | None) -> str:
    """``error`` with its varying parts replaced (first line only), for grouping."""
    if not error or not error.strip():
        return "(no error recorded)"
    text = first_line(error)
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return text.strip()[:FINGERPRINT_MAX]


def group_key(error: str | None) -> str:
    """The stable 8-hex-digit key of ``error``'s fingerprint."""
    return hashlib.sha256(fingerprint(error).encode()).hexdigest()[:8]


def default_operator() -> str:
    """``user@host`` of whoever runs the command, recorded with every re-drive and skip."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def list_dead(conn: Conn, names: OutboxNames, flt: DeadFilter, *, limit: int | None = None) -> DeadPage:
    """Dead messages matching ``flt`` in id order, at most ``limit`` of them (None: all)."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(ops_query(names, "dead_list"), {**flt.params(), "limit": limit})
    rows = await cur.fetchall()
    messages = tuple(
        DeadMessage(
            id=r["id"],
            aggregate_type=r["aggregate_type"],
            aggregate_id=r["aggregate_id"],
            event_type=r["event_type"],
            attempts=r["attempts"],
            created_at=r["created_at"],
            # Rows written before last_error was masked on the way in are masked on the way out.
            last_error=mask(r["last_error"]) if r["last_error"] else r["last_error"],
            ordered=r["ordered"],
            lease_version=r["lease_version"],
            blocking=r["blocking"],
            resolution=r["resolution"],
            resolved_by=r["resolved_by"],
            resolved_at=r["resolved_at"],
        )
        for r in rows
    )
    total = int(rows[0]["total"]) if rows else 0
    return DeadPage(at=rows[0]["now"] if rows else None, messages=messages, total=total)


async def group_dead(conn: Conn, names: OutboxNames, flt: DeadFilter) -> tuple[DeadGroup, ...]:
    """Dead messages matching ``flt`` grouped by error fingerprint, largest group first."""
    page = await list_dead(conn, names, flt)
    return group_messages(page.messages)


def group_messages(messages: Sequence[DeadMessage]) -> tuple[DeadGroup, ...]:
    """Group ``messages`` by :func:`group_key` of their last error."""
    buckets: dict[str, list[DeadMessage]] = {}
    for m in messages:
        buckets.setdefault(m.group, []).append(m)
    groups = [
        DeadGroup(
            key=key,
            fingerprint=ms[0].fingerprint,
            count=len(ms),
            blocking=sum(m.blocking for m in ms),
            event_types=tuple(sorted({m.event_type for m in ms})),
            first_id=ms[0].id,
            last_id=ms[-1].id,
            sample_error=ms[-1].last_error,
            ids=tuple(m.id for m in ms),
        )
        for key, ms in buckets.items()
    ]
    return tuple(sorted(groups, key=lambda g: (-g.count, g.first_id)))


async def select_ids(conn: Conn, names: OutboxNames, flt: DeadFilter, group: str | None = None) -> list[int]:
    """Ids of the dead messages matching ``flt`` (and in ``group``, when given), in id order.

    An empty match is a ConfigError naming the filter, so a write never silently does nothing.
    """
    page = await list_dead(conn, names, flt)
    ids = [m.id for m in page.messages if group is None or m.group == group]
    if not ids:
        what = flt.describe()
        if group is not None:
            what = f"group {group}" + ("" if flt.is_empty() else f", {what}")
        raise ConfigError(f"no dead messages match {what} in {names.qualified}; nothing changed")
    return ids


async def retry(
    conn: Conn,
    names: OutboxNames,
    ids: Sequence[int],
    *,
    by: str,
    note: str | None = None,
    dry_run: bool = False,
) -> WriteResult:
    """Re-drive the dead messages ``ids``: pending, attempts 0, available now, in id order."""
    return await _write(conn, names, "retry", ids, by=by, note=note, dry_run=dry_run)


async def skip(
    conn: Conn,
    names: OutboxNames,
    ids: Sequence[int],
    *,
    by: str,
    reason: str,
    dry_run: bool = False,
) -> WriteResult:
    """Mark the dead messages ``ids`` done without delivery, recording ``by`` and ``reason``."""
    if not reason.strip():
        raise ConfigError("a skip needs a reason: pass --reason TEXT (it is recorded with the message)")
    return await _write(conn, names, "skip", ids, by=by, note=reason, dry_run=dry_run)


async def _write(
    conn: Conn,
    names: OutboxNames,
    action: Action,
    ids: Sequence[int],
    *,
    by: str,
    note: str | None,
    dry_run: bool,
) -> WriteResult:
    wanted = sorted(set(ids))
    if not wanted:
        raise ConfigError(f"nothing to {action}: give dead message ids, a filter or a group")
    async with conn.transaction():
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(ops_query(names, "dead_lock"), {"ids": wanted})
        found = {r["id"]: r for r in await cur.fetchall()}
        refused = tuple(
            Refusal(i, "unknown id" if i not in found else f"not dead (status {found[i]['status']})")
            for i in wanted
            if i not in found or found[i]["status"] != "dead"
        )
        candidates = tuple(_touched(found[i]) for i in wanted if i in found and found[i]["status"] == "dead")
        if refused or dry_run:
            # Nothing to write; the transaction ends holding only the row locks it took.
            return WriteResult(action, dry_run, candidates, refused, by, note)
        statement = "dead_retry" if action == "retry" else "dead_skip"
        await cur.execute(ops_query(names, statement), {"ids": wanted, "by": by, "note": note})
        changed = tuple(sorted((_touched(r) for r in await cur.fetchall()), key=lambda t: t.id))
    verb = "re-driven to pending" if action == "retry" else "skipped (done without delivery)"
    for t in changed:
        log.info("dead message %s by %s", verb, by, extra=t.log_fields())
    return WriteResult(action, dry_run, changed, (), by, note)


def _touched(r: dict[str, Any]) -> Touched:
    return Touched(
        id=r["id"],
        aggregate_id=r["aggregate_id"],
        event_type=r["event_type"],
        lease_version=r["lease_version"],
        ordered=r["ordered"],
    )


def refusal_line(result: WriteResult) -> str:
    """One line naming every refused id, for the CLI's error exit."""
    reasons = "; ".join(f"{r.id}: {r.reason}" for r in result.refused)
    return f"refused to {result.action} (nothing changed): {reasons}"


def _ids_text(items: Sequence[object], limit: int = 20) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


def render_write(result: WriteResult) -> str:
    """What a re-drive or skip did (or, in a dry run, would do), for people."""
    ids = [t.id for t in result.changed]
    aggregates = [printable(a) for a in sorted({t.aggregate_id for t in result.changed if t.ordered})]
    noun = f"{len(ids):,} dead message{'s' if len(ids) != 1 else ''}"
    if result.action == "retry":
        verb, detail, onward = "re-drove", "to pending (attempts reset, available now, in id order)", "resume in order"
    else:
        verb, detail, onward = "skipped", "(marked done without delivery)", "move on to their next message"
    verb = verb.capitalize()
    if result.dry_run:
        verb = "dry run: would " + ("re-drive" if result.action == "retry" else "skip")
    lines = [f"{verb} {noun} {detail}", f"  ids: {_ids_text(ids)}", f"  by: {escape(result.by)}"]
    if result.note:
        lines.append(f"  reason: {escape(result.note)}")
    if aggregates:
        lines.append(f"  ordered aggregates that {'would ' if result.dry_run else ''}{onward}: {_ids_text(aggregates)}")
    if result.dry_run:
        lines.append("  nothing changed")
    return "\n".join(lines)


def render_list(page: DeadPage, flt: DeadFilter) -> str:
    """`relay dead list` as a table, oldest id first."""
    if not page.messages:
        return "no dead messages" if flt.is_empty() else f"no dead messages match {flt.describe()}"
    at = page.at
    rows = [
        (
            str(m.id),
            printable(m.event_type),
            printable(m.aggregate_id),
            str(m.attempts),
            age_text((at - m.created_at).total_seconds()) if at else "?",
            "yes" if m.blocking else "",
            _one_line(m.last_error, 80),
        )
        for m in page.messages
    ]
    header = ("ID", "EVENT TYPE", "AGGREGATE", "ATT", "AGE", "BLOCKS", "LAST ERROR")
    out = _table(header, rows, right=(0, 3))
    if page.total > len(page.messages):
        out += f"\n{page.total - len(page.messages):,} more not shown (--limit)"
    blocking = sum(m.blocking for m in page.messages)
    if blocking:
        out += f"\n{blocking:,} of these block their ordered aggregate (BLOCKS): `relay explain AGGREGATE_ID`"
    return out


def render_groups(groups: Sequence[DeadGroup], flt: DeadFilter) -> str:
    """`relay dead list --group`: one line per error fingerprint."""
    if not groups:
        return "no dead messages" if flt.is_empty() else f"no dead messages match {flt.describe()}"
    rows = [
        (
            g.key,
            f"{g.count:,}",
            f"{g.blocking:,}",
            ", ".join(printable(t) for t in g.event_types[:3]) + (", ..." if len(g.event_types) > 3 else ""),
            f"{g.first_id}..{g.last_id}" if g.first_id != g.last_id else str(g.first_id),
            escape(g.fingerprint),
        )
        for g in groups
    ]
    header = ("GROUP", "COUNT", "BLOCKING", "EVENT TYPES", "IDS", "ERROR FINGERPRINT")
    total = sum(g.count for g in groups)
    return (
        _table(header, rows, right=(1, 2))
        + f"\n{total:,} dead messages in {len(groups):,} groups;"
        + " re-drive one with `relay dead retry --group GROUP`"
    )


def _one_line(text: str | None, width: int) -> str:
    if not text:
        return "-"
    line = escape(" ".join(text.split()))
    return line if len(line) <= width else line[: width - 3] + "..."


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    return "\n".join([fmt(header), *(fmt(r) for r in rows)])
