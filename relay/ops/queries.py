"""The operator tools' reads and writes: the only operator code that names ``sql/ops.sql``
statements and runs them.

Every function here runs one statement (or a fixed few) and returns frozen dataclasses,
one ``from_row`` per row type, so the modules above it (status, explain, deadletters,
prune, release) hold only logic over plain objects and can be tested without PostgreSQL.
Nothing here decides anything: no verdicts, no refusals, no text for people.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from relay.dsn import mask
from relay.sqlfiles import named_queries
from relay.sqlnames import OutboxNames

Conn = psycopg.AsyncConnection[Any]
Row = dict[str, Any]


@cache
def ops_query(names: OutboxNames, name: str) -> sql.Composed:
    """The named statement ``name`` of ``sql/*.sql`` rendered for ``names``, once per process."""
    return names.render(named_queries()[name])


async def _all(conn: Conn, names: OutboxNames, name: str, params: Mapping[str, Any] | None = None) -> list[Row]:
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(ops_query(names, name), params)
    return await cur.fetchall()


async def _one(conn: Conn, names: OutboxNames, name: str, params: Mapping[str, Any] | None = None) -> Row:
    """The row of a statement that always returns exactly one (aggregates, SELECT without FROM)."""
    rows = await _all(conn, names, name, params)
    if not rows:
        raise RuntimeError(f"{name} returned no row")
    return rows[0]


def _masked(error: str | None) -> str | None:
    # Rows written before last_error was masked on the way in are masked on the way out.
    return mask(error) if error else error


def _fields_masked(r: Row) -> dict[str, Any]:
    """A row whose columns are exactly a dataclass's fields, its ``last_error`` masked."""
    return {**r, "last_error": _masked(r["last_error"])}


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
        await _one(conn, names, "status_summary", {"schema": names.schema, "table": names.table})
    )


async def status_attempts(conn: Conn, names: OutboxNames) -> dict[int, int]:
    """Attempts used so far -> messages awaiting delivery."""
    return {int(r["attempts"]): int(r["n"]) for r in await _all(conn, names, "status_attempts")}


async def status_by_event_type(conn: Conn, names: OutboxNames) -> list[EventTypeRow]:
    return [EventTypeRow.from_row(r) for r in await _all(conn, names, "status_by_event_type")]


async def status_wakeups(conn: Conn, names: OutboxNames) -> WakeupStatus | None:
    rows = await _all(conn, names, "status_wakeups")
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
        return cls(
            id=r["id"],
            event_type=r["event_type"],
            status=r["status"],
            attempts=r["attempts"],
            last_error=_masked(r["last_error"]),
            available_at=r["available_at"],
            lease_owner=r["lease_owner"],
            lease_until=r["lease_until"],
            lease_version=r["lease_version"],
            created_at=r["created_at"],
            aggregate_seq=r["aggregate_seq"],
            resolution=r["resolution"],
            resolved_by=r["resolved_by"],
            resolved_at=r["resolved_at"],
        )


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
    h = await _one(conn, names, "explain_head", params)
    o = await _one(conn, names, "explain_ordered", params)
    u = await _one(conn, names, "explain_unordered", params)
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
        return cls(
            id=r["id"],
            aggregate_type=r["aggregate_type"],
            aggregate_id=r["aggregate_id"],
            event_type=r["event_type"],
            attempts=r["attempts"],
            created_at=r["created_at"],
            last_error=_masked(r["last_error"]),
            ordered=r["ordered"],
            lease_version=r["lease_version"],
            blocking=r["blocking"],
            resolution=r["resolution"],
            resolved_by=r["resolved_by"],
            resolved_at=r["resolved_at"],
        )


@dataclass(frozen=True)
class DeadPage:
    """The dead messages that matched, up to the limit, and how many matched in all."""

    at: datetime | None
    messages: tuple[DeadMessage, ...]
    total: int


@dataclass(frozen=True)
class LockedRow:
    """A row a re-drive or skip named, locked, in whatever status it is."""

    id: int
    status: str
    aggregate_id: str
    event_type: str
    lease_version: int
    ordered: bool

    @classmethod
    def from_row(cls, r: Row) -> LockedRow:
        return cls(r["id"], r["status"], r["aggregate_id"], r["event_type"], r["lease_version"], r["ordered"])


@dataclass(frozen=True)
class Touched:
    """A row a re-drive or skip changed (or, in a dry run, would change)."""

    id: int
    aggregate_id: str
    event_type: str
    lease_version: int
    ordered: bool

    @classmethod
    def from_row(cls, r: Row) -> Touched:
        return cls(r["id"], r["aggregate_id"], r["event_type"], r["lease_version"], r["ordered"])


async def dead_list(conn: Conn, names: OutboxNames, flt: DeadFilter, limit: int | None = None) -> DeadPage:
    """Dead messages matching ``flt`` in id order, at most ``limit`` of them (None: all)."""
    rows = await _all(conn, names, "dead_list", {**flt.params(), "limit": limit})
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
    rows = await _all(conn, names, "dead_groups", {**flt.params(), "group": group, "limit": limit, "offset": offset})
    groups = tuple(
        GroupRow(
            group=r["dead_group"],
            count=r["n"],
            first_id=r["first_id"],
            last_id=r["last_id"],
            fingerprint=_masked(r["fingerprint"]) or "",
            sample_error=_masked(r["sample_error"]),
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
        first = await _all(conn, names, "dead_groups", {**flt.params(), "group": group, "limit": 1, "offset": 0})
        total_groups = int(first[0]["groups"]) if first else 0
        total = int(first[0]["total"]) if first else 0
    return GroupsPage(groups, total_groups, total)


async def dead_ids(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, group: int | None, limit: int | None
) -> list[int]:
    """Ids of the dead messages matching ``flt`` (in ``group`` when given), in id order."""
    rows = await _all(conn, names, "dead_ids", {**flt.params(), "group": group, "limit": limit})
    return [r["id"] for r in rows]


async def dead_group_page(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, group: int, after: int, limit: int
) -> tuple[DeadMessage, ...]:
    """``limit`` dead messages of ``group`` matching ``flt`` with ids above ``after``."""
    params = {**flt.params(), "group": group, "after": after, "limit": limit}
    return tuple(DeadMessage.from_row(r) for r in await _all(conn, names, "dead_group_page", params))


async def dead_lock(conn: Conn, names: OutboxNames, ids: Sequence[int]) -> list[LockedRow]:
    """Lock the rows ``ids`` (those that exist) in id order, FOR UPDATE."""
    return [LockedRow.from_row(r) for r in await _all(conn, names, "dead_lock", {"ids": list(ids)})]


async def dead_retry(conn: Conn, names: OutboxNames, ids: Sequence[int], *, by: str, note: str | None) -> list[Touched]:
    """Back to pending, attempts 0, available now: the rows of ``ids`` still dead."""
    params = {"ids": list(ids), "by": by, "note": note}
    return [Touched.from_row(r) for r in await _all(conn, names, "dead_retry", params)]


async def dead_skip(conn: Conn, names: OutboxNames, ids: Sequence[int], *, by: str, note: str | None) -> list[Touched]:
    """Done without delivery: the rows of ``ids`` still dead."""
    params = {"ids": list(ids), "by": by, "note": note}
    return [Touched.from_row(r) for r in await _all(conn, names, "dead_skip", params)]


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
        return cls(**_fields_masked(r))


async def blocked_heads(conn: Conn, names: OutboxNames, limit: int) -> list[BlockedHead]:
    """Aggregates whose head is dead, oldest dead head first, at most ``limit``."""
    return [BlockedHead.from_row(r) for r in await _all(conn, names, "console_blocked", {"limit": limit})]


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
        return cls(**_fields_masked(r))


async def event_types_top(conn: Conn, names: OutboxNames, limit: int) -> tuple[list[EventTypeRow], int]:
    """status_by_event_type's rows for the ``limit`` event types with the most unfinished
    rows, and how many event types have unfinished rows in all."""
    rows = await _all(conn, names, "console_event_types", {"limit": limit})
    return [EventTypeRow.from_row(r) for r in rows], int(rows[0]["types"]) if rows else 0


async def payload_parts(conn: Conn, names: OutboxNames, outbox_id: int, size: int) -> AsyncIterator[bytes]:
    """A payload's JSON text, UTF-8, in parts of ``size`` bytes, read one part at a time
    through a server-side cursor (inside a transaction of its own); nothing when there is
    no such row."""
    async with conn.transaction():
        cur = conn.cursor(name=f"payload_{outbox_id}")
        cur.itersize = 1
        await cur.execute(ops_query(names, "console_payload_parts"), {"id": outbox_id, "size": size})
        async for (part,) in cur:
            yield bytes(part)


async def message_detail(conn: Conn, names: OutboxNames, outbox_id: int) -> MessageDetail | None:
    rows = await _all(conn, names, "console_message", {"id": outbox_id})
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
        return cls(**_fields_masked(r))


async def aggregate_messages(
    conn: Conn, names: OutboxNames, aggregate_id: str, *, recent: int, limit: int
) -> list[AggregateMessage]:
    """``aggregate_id``'s messages newest first, at most ``limit``: every unfinished one, and
    the finished ones among the table's newest ``recent`` ids."""
    params = {"aggregate_id": aggregate_id, "recent": recent, "limit": limit}
    return [AggregateMessage.from_row(r) for r in await _all(conn, names, "console_aggregate_messages", params)]


# ---- release


@dataclass(frozen=True)
class LeaseRow:
    """A row `relay release` named or found by owner, locked, in whatever status it is."""

    now: datetime
    id: int
    status: str
    aggregate_id: str
    event_type: str
    lease_owner: str | None
    lease_version: int
    lease_until: datetime | None
    attempts: int
    ordered: bool
    aggregate_seq: int | None

    @classmethod
    def from_row(cls, r: Row) -> LeaseRow:
        return cls(
            now=r["now"],
            id=r["id"],
            status=r["status"],
            aggregate_id=r["aggregate_id"],
            event_type=r["event_type"],
            lease_owner=r["lease_owner"],
            lease_version=r["lease_version"],
            lease_until=r["lease_until"],
            attempts=r["attempts"],
            ordered=r["ordered"],
            aggregate_seq=r["aggregate_seq"],
        )


@dataclass(frozen=True)
class LeaseHolder:
    """A lease owner and how many processing rows it holds."""

    lease_owner: str | None
    n: int

    @classmethod
    def from_row(cls, r: Row) -> LeaseHolder:
        return cls(r["lease_owner"], int(r["n"]))


async def lease_rows(
    conn: Conn, names: OutboxNames, *, ids: Sequence[int] = (), owner: str | None = None
) -> list[LeaseRow]:
    """Lock the rows ``ids`` (any status), or else the processing rows of ``owner`` (that
    lease owner or its ``owner:...`` workers), in id order, FOR UPDATE."""
    if ids:
        rows = await _all(conn, names, "release_by_ids", {"ids": list(ids)})
    else:
        rows = await _all(conn, names, "release_by_owner", {"owner": owner})
    return [LeaseRow.from_row(r) for r in rows]


async def lease_holders(conn: Conn, names: OutboxNames) -> list[LeaseHolder]:
    """The ten owners holding the most processing rows."""
    return [LeaseHolder.from_row(r) for r in await _all(conn, names, "release_holders")]


async def release_leases(
    conn: Conn,
    names: OutboxNames,
    held: Sequence[tuple[int, int]],
    *,
    max_attempts: int,
    by: str,
    note: str | None,
) -> set[int]:
    """Release the ``(id, lease_version)`` rows still processing at that version; the ids written."""
    params = {
        "ids": [i for i, _ in held],
        "versions": [v for _, v in held],
        "max_attempts": max_attempts,
        "by": by,
        "note": note,
    }
    return {r["id"] for r in await _all(conn, names, "release", params)}


# ---- prune


@dataclass(frozen=True)
class PruneChunk:
    """What one prune statement read and deleted (or, counting, would delete)."""

    scanned: int
    last_id: int | None
    all_newer: bool  # every row of the chunk was created after the cutoff
    done: int
    dead: int

    @classmethod
    def from_row(cls, r: Row) -> PruneChunk:
        return cls(r["scanned"], r["last_id"], r["all_newer"], r["done"], r["dead"])


async def prune_cutoff(conn: Conn, names: OutboxNames, older_than: timedelta) -> datetime:
    """The database clock minus ``older_than``."""
    cutoff: datetime = (await _one(conn, names, "prune_cutoff", {"older_than": older_than}))["cutoff"]
    return cutoff


async def prune_chunk(
    conn: Conn,
    names: OutboxNames,
    *,
    after_id: int,
    batch: int,
    cutoff: datetime,
    include_dead: bool,
    dry_run: bool,
) -> PruneChunk:
    """Delete (``dry_run``: count) the qualifying rows of the ``batch`` ids after ``after_id``."""
    params = {"after_id": after_id, "batch": batch, "cutoff": cutoff, "include_dead": include_dead}
    return PruneChunk.from_row(await _one(conn, names, "prune_chunk_count" if dry_run else "prune_chunk", params))


@dataclass(frozen=True)
class BlockingDead:
    """The dead ordered rows created before a prune's cutoff: how many, of how many
    aggregates, and the first aggregate ids by name."""

    n: int
    aggregates: int
    sample: tuple[str, ...]


async def prune_blocking_count(conn: Conn, names: OutboxNames, cutoff: datetime, sample: int) -> BlockingDead:
    """Count the dead ordered rows created before ``cutoff``; ``sample`` aggregate ids."""
    r = await _one(conn, names, "prune_blocking_count", {"cutoff": cutoff, "sample": sample})
    return BlockingDead(r["n"], r["aggregates"], tuple(r["sample"]))


async def prune_blocking_page(conn: Conn, names: OutboxNames, cutoff: datetime, after_id: int, batch: int) -> list[int]:
    """Ids of the next ``batch`` dead ordered rows created before ``cutoff``, after ``after_id``."""
    rows = await _all(conn, names, "prune_blocking_page", {"cutoff": cutoff, "after_id": after_id, "batch": batch})
    return [r["id"] for r in rows]


@dataclass(frozen=True)
class HeadsChunk:
    """What one prune_heads_chunk statement read and forgot (or, in a dry run, would)."""

    scanned: int
    last: str | None
    idle: int
    forgotten: int


async def prune_heads_chunk(
    conn: Conn, names: OutboxNames, *, after: str, batch: int, cutoff: datetime, dry_run: bool
) -> HeadsChunk:
    """Forget the idle heads among the ``batch`` heads rows after ``after``, holding the
    ingest's turn for that (one short transaction); in a dry run, count them."""
    async with conn.transaction():
        await conn.execute(ops_query(names, "prune_heads_turn"))
        params = {"after": after, "batch": batch, "cutoff": cutoff, "dry_run": dry_run}
        r = await _one(conn, names, "prune_heads_chunk", params)
    return HeadsChunk(r["scanned"], r["last"], r["idle"], r["forgotten"])


async def prune_heads_waiting(conn: Conn, names: OutboxNames, limit: int) -> int:
    """Committed ordered rows waiting to be numbered, counted up to ``limit``."""
    n: int = (await _one(conn, names, "prune_heads_waiting", {"limit": limit}))["n"]
    return n


# ---- readiness


async def ready_probe(conn: Conn, names: OutboxNames) -> None:
    """A zero-row read of the outbox table: raises unless it exists and is readable."""
    await conn.execute(ops_query(names, "ready_probe"))
