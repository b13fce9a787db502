"""What operators and the console read: the queue's status, one aggregate, the dead
messages and their groups, the blocked aggregates, one message; and the readiness probe.

Every function here runs one statement (or a fixed few) and returns frozen dataclasses,
so the modules above it (relay.ops, relay.console, relay.metrics) hold only logic over
plain objects and can be tested without PostgreSQL. Nothing here decides anything: no
verdicts, no refusals, no text for people.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.db.names import OutboxNames
from relay.db.rows import Conn, Row, fetch_all, fetch_one, masked, masked_row
from relay.db.statements import statement

__all__ = ["Conn", "Row"]


# ---- status


@dataclass(frozen=True)
class SummaryRow:
    """The ``status_summary`` row: counts, and the moments ages are measured from."""

    now: datetime
    pending_unordered: int
    pending_ordered: int
    processing: int
    expired_leases: int
    dead: int
    oldest_waiting_at: datetime | None
    oldest_dead_at: datetime | None
    blocked_aggregates: int
    oldest_blocked_at: datetime | None
    waiting_behind_blocked: int
    live_estimate: int | None  # the statistics system's live-row estimate
    total_bytes: int | None

    @classmethod
    def from_row(cls, r: Row) -> SummaryRow:
        live = r["live_estimate"]
        return cls(
            now=r["now"],
            pending_unordered=r["pending_unordered"],
            pending_ordered=r["pending_ordered"],
            processing=r["processing"],
            expired_leases=r["expired_leases"],
            dead=r["dead"],
            oldest_waiting_at=r["oldest_waiting_at"],
            oldest_dead_at=r["oldest_dead_at"],
            blocked_aggregates=r["blocked_aggregates"],
            oldest_blocked_at=r["oldest_blocked_at"],
            waiting_behind_blocked=int(r["waiting_behind_blocked"]),
            live_estimate=None if live is None else int(live),
            total_bytes=r["total_bytes"],
        )


@dataclass(frozen=True)
class EventTypeRow:
    """One ``status_by_event_type`` row: the unfinished rows of one event type in one status."""

    event_type: str
    status: str
    n: int
    oldest: datetime
    expired: int

    @classmethod
    def from_row(cls, r: Row) -> EventTypeRow:
        return cls(r["event_type"], r["status"], int(r["n"]), r["oldest"], int(r["expired"]))


@dataclass(frozen=True)
class WakeupStatus:
    """Who producers would wake: relay processes listening, and whether they notify now."""

    listening: int  # relay processes whose row in <table>_listeners has not expired
    idle: int  # of those, the ones waiting for a wake-up
    producers_notify: bool  # every one of them idle (and notify on): inserts send NOTIFY

    @classmethod
    def from_row(cls, r: Row) -> WakeupStatus:
        return cls(int(r["listening"]), int(r["idle"]), bool(r["producers_notify"]))


async def status_summary(conn: Conn, names: OutboxNames) -> SummaryRow:
    return SummaryRow.from_row(
        await fetch_one(conn, names, "status_summary", {"schema": names.schema, "table": names.table})
    )


async def status_attempts(conn: Conn, names: OutboxNames) -> dict[int, int]:
    """Attempts used so far -> messages awaiting delivery."""
    return {int(r["attempts"]): int(r["n"]) for r in await fetch_all(conn, names, "status_attempts")}


async def status_by_event_type(conn: Conn, names: OutboxNames) -> list[EventTypeRow]:
    return [EventTypeRow.from_row(r) for r in await fetch_all(conn, names, "status_by_event_type")]


async def status_wakeups(conn: Conn, names: OutboxNames) -> WakeupStatus | None:
    rows = await fetch_all(conn, names, "status_wakeups")
    return WakeupStatus.from_row(rows[0]) if rows else None


# ---- explain


@dataclass(frozen=True)
class HeadMessage:
    """The message at the head of the aggregate's ordered sequence."""

    id: int
    event_type: str
    status: str
    attempts: int
    last_error: str | None
    available_at: datetime
    lease_owner: str | None
    lease_until: datetime | None
    lease_version: int
    created_at: datetime
    aggregate_seq: int | None
    resolution: str | None  # the last operator action on it ('retried'), if any
    resolved_by: str | None
    resolved_at: datetime | None

    @classmethod
    def from_row(cls, r: Row) -> HeadMessage:
        return masked_row(cls, r)


@dataclass(frozen=True)
class AggregateRows:
    """What the database holds about one aggregate id, by its clock ``now``."""

    now: datetime
    has_heads_row: bool  # the aggregate has ordered history (a row in <table>_heads)
    last_seq: int | None  # the last aggregate_seq handed out
    head: HeadMessage | None
    ordered: int  # numbered unfinished ordered messages, the head among them
    not_numbered: int  # ordered messages committed but not numbered by an ingest yet
    unordered_pending: int
    unordered_processing: int
    unordered_dead: int


async def aggregate_rows(conn: Conn, names: OutboxNames, aggregate_id: str) -> AggregateRows:
    params = {"aggregate_id": aggregate_id}
    h = await fetch_one(conn, names, "explain_head", params)
    o = await fetch_one(conn, names, "explain_ordered", params)
    u = await fetch_one(conn, names, "explain_unordered", params)
    return AggregateRows(
        now=h["now"],
        has_heads_row=h["has_heads_row"],
        last_seq=h["last_seq"],
        head=HeadMessage.from_row(h) if h["id"] is not None else None,
        ordered=o["n"],
        not_numbered=o["not_numbered"],
        unordered_pending=u["pending"],
        unordered_processing=u["processing"],
        unordered_dead=u["dead"],
    )


# ---- dead messages


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

    @classmethod
    def from_row(cls, r: Row) -> DeadMessage:
        return masked_row(cls, r)


@dataclass(frozen=True)
class DeadPage:
    """The dead messages that matched, up to the limit, and how many matched in all."""

    at: datetime | None
    messages: tuple[DeadMessage, ...]
    total: int


async def dead_list(conn: Conn, names: OutboxNames, flt: DeadFilter, limit: int | None = None) -> DeadPage:
    """Dead messages matching ``flt`` in id order, at most ``limit`` of them (None: all)."""
    rows = await fetch_all(conn, names, "dead_list", {**flt.params(), "limit": limit})
    messages = tuple(DeadMessage.from_row(r) for r in rows)
    return DeadPage(at=rows[0]["now"] if rows else None, messages=messages, total=int(rows[0]["total"]) if rows else 0)


@dataclass(frozen=True)
class GroupRow:
    """One group of dead messages as dead_groups counts it (sql/ops.sql)."""

    group: int  # dead_group, a signed 64-bit key
    count: int
    first_id: int
    last_id: int
    fingerprint: str
    sample_error: str | None  # the first 2,000 characters of the last message's error
    sample_length: int  # the whole error's length
    event_types: tuple[str, ...]  # among the group's first 100 messages
    blocking: int


@dataclass(frozen=True)
class GroupsPage:
    groups: tuple[GroupRow, ...]
    total_groups: int  # how many groups matched, on every page
    total: int  # how many dead messages they hold


async def dead_groups(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, group: int | None, limit: int, offset: int
) -> GroupsPage:
    """One page of the groups of dead messages matching ``flt``, largest first."""
    rows = await fetch_all(
        conn, names, "dead_groups", {**flt.params(), "group": group, "limit": limit, "offset": offset}
    )
    groups = tuple(
        GroupRow(
            group=r["dead_group"],
            count=r["n"],
            first_id=r["first_id"],
            last_id=r["last_id"],
            fingerprint=masked(r["fingerprint"]) or "",
            sample_error=masked(r["sample_error"]),
            sample_length=r["sample_length"] or 0,
            event_types=tuple(r["event_types"]),
            blocking=r["blocking"],
        )
        for r in rows
    )
    total_groups = int(rows[0]["groups"]) if rows else 0
    total = int(rows[0]["total"]) if rows else 0
    if not rows and offset:
        # Past the last page: count what there is, so the page can say so.
        first = await fetch_all(conn, names, "dead_groups", {**flt.params(), "group": group, "limit": 1, "offset": 0})
        total_groups = int(first[0]["groups"]) if first else 0
        total = int(first[0]["total"]) if first else 0
    return GroupsPage(groups, total_groups, total)


async def dead_ids(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, group: int | None, limit: int | None
) -> list[int]:
    """Ids of the dead messages matching ``flt`` (in ``group`` when given), in id order."""
    rows = await fetch_all(conn, names, "dead_ids", {**flt.params(), "group": group, "limit": limit})
    return [r["id"] for r in rows]


async def dead_group_page(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, group: int, after: int, limit: int
) -> tuple[DeadMessage, ...]:
    """``limit`` dead messages of ``group`` matching ``flt`` with ids above ``after``."""
    params = {**flt.params(), "group": group, "after": after, "limit": limit}
    return tuple(DeadMessage.from_row(r) for r in await fetch_all(conn, names, "dead_group_page", params))


# ---- the console (relay.console): blocked aggregates, one message, one aggregate's messages


@dataclass(frozen=True)
class BlockedHead:
    """A dead message at the head of its ordered aggregate, and what waits behind it."""

    now: datetime
    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    attempts: int
    created_at: datetime
    last_error: str | None
    aggregate_seq: int | None
    behind: int

    @classmethod
    def from_row(cls, r: Row) -> BlockedHead:
        return masked_row(cls, r)


async def blocked_heads(conn: Conn, names: OutboxNames, limit: int) -> list[BlockedHead]:
    """Aggregates whose head is dead, oldest dead head first, at most ``limit``."""
    return [BlockedHead.from_row(r) for r in await fetch_all(conn, names, "console_blocked", {"limit": limit})]


@dataclass(frozen=True)
class MessageDetail:
    """One outbox row whole, with its aggregate's head and counter (``head_id`` None: the
    aggregate has no ordered history, or nothing of it waits)."""

    now: datetime
    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: str  # the JSON text as stored, its first 1,024 characters
    payload_length: int  # the whole text's length, in characters
    headers: str | None
    created_at: datetime
    status: str
    available_at: datetime
    attempts: int
    lease_owner: str | None
    lease_until: datetime | None
    lease_version: int
    last_error: str | None  # its first 8,192 characters
    last_error_length: int | None
    done_at: datetime | None
    ordered: bool
    aggregate_seq: int | None
    resolution: str | None
    resolved_by: str | None
    resolved_at: datetime | None
    resolved_note: str | None
    head_id: int | None
    head_seq: int | None
    last_seq: int | None

    @classmethod
    def from_row(cls, r: Row) -> MessageDetail:
        return masked_row(cls, r)


async def event_types_top(conn: Conn, names: OutboxNames, limit: int) -> tuple[list[EventTypeRow], int]:
    """status_by_event_type's rows for the ``limit`` event types with the most unfinished
    rows, and how many event types have unfinished rows in all."""
    rows = await fetch_all(conn, names, "console_event_types", {"limit": limit})
    return [EventTypeRow.from_row(r) for r in rows], int(rows[0]["types"]) if rows else 0


async def payload_parts(conn: Conn, names: OutboxNames, outbox_id: int, size: int) -> AsyncIterator[bytes]:
    """A payload's JSON text, UTF-8, in parts of ``size`` bytes, read one part at a time
    through a server-side cursor (inside a transaction of its own); nothing when there is
    no such row."""
    async with conn.transaction():
        cur = conn.cursor(name=f"payload_{outbox_id}")
        cur.itersize = 1
        await cur.execute(statement(names, "console_payload_parts"), {"id": outbox_id, "size": size})
        async for (part,) in cur:
            yield bytes(part)


async def message_detail(conn: Conn, names: OutboxNames, outbox_id: int) -> MessageDetail | None:
    rows = await fetch_all(conn, names, "console_message", {"id": outbox_id})
    return MessageDetail.from_row(rows[0]) if rows else None


@dataclass(frozen=True)
class AggregateMessage:
    """A line of an aggregate's message list."""

    id: int
    event_type: str
    status: str
    attempts: int
    created_at: datetime
    done_at: datetime | None
    ordered: bool
    aggregate_seq: int | None
    last_error: str | None
    resolution: str | None

    @classmethod
    def from_row(cls, r: Row) -> AggregateMessage:
        return masked_row(cls, r)


async def aggregate_messages(
    conn: Conn, names: OutboxNames, aggregate_id: str, *, recent: int, limit: int
) -> list[AggregateMessage]:
    """``aggregate_id``'s messages newest first, at most ``limit``: every unfinished one, and
    the finished ones among the table's newest ``recent`` ids."""
    params = {"aggregate_id": aggregate_id, "recent": recent, "limit": limit}
    return [AggregateMessage.from_row(r) for r in await fetch_all(conn, names, "console_aggregate_messages", params)]


# ---- readiness


async def ready_probe(conn: Conn, names: OutboxNames) -> None:
    """A zero-row read of the outbox table: raises unless it exists and is readable."""
    await conn.execute(statement(names, "ready_probe"))


async def claim_probe(conn: Conn, names: OutboxNames) -> None:
    """A zero-row lock of the outbox's rows: raises unless a claim could run now (the table
    there, this role allowed to lock its rows, the database taking writes)."""
    await conn.execute(statement(names, "claim_probe"))
