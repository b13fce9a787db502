"""What operators change: dead messages re-driven or skipped (`relay dead retry`,
`relay dead skip`, the console's buttons), leases released (`relay release`). Each write
is fenced like the relay's own: it touches a row only in the state the caller read it in.
Rows as frozen dataclasses; the decisions and the words are relay.ops's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from relay.db.names import OutboxNames
from relay.db.rows import Conn, Row, fetch_all


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


async def dead_lock(conn: Conn, names: OutboxNames, ids: Sequence[int]) -> list[LockedRow]:
    """Lock the rows ``ids`` (those that exist) in id order, FOR UPDATE."""
    return [LockedRow.from_row(r) for r in await fetch_all(conn, names, "dead_lock", {"ids": list(ids)})]


async def dead_retry(conn: Conn, names: OutboxNames, ids: Sequence[int], *, by: str, note: str | None) -> list[Touched]:
    """Back to pending, attempts 0, available now: the rows of ``ids`` still dead."""
    params = {"ids": list(ids), "by": by, "note": note}
    return [Touched.from_row(r) for r in await fetch_all(conn, names, "dead_retry", params)]


async def dead_skip(conn: Conn, names: OutboxNames, ids: Sequence[int], *, by: str, note: str | None) -> list[Touched]:
    """Done without delivery: the rows of ``ids`` still dead."""
    params = {"ids": list(ids), "by": by, "note": note}
    return [Touched.from_row(r) for r in await fetch_all(conn, names, "dead_skip", params)]


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
        rows = await fetch_all(conn, names, "release_by_ids", {"ids": list(ids)})
    else:
        rows = await fetch_all(conn, names, "release_by_owner", {"owner": owner})
    return [LeaseRow.from_row(r) for r in rows]


async def lease_holders(conn: Conn, names: OutboxNames) -> list[LeaseHolder]:
    """The ten owners holding the most processing rows."""
    return [LeaseHolder.from_row(r) for r in await fetch_all(conn, names, "release_holders")]


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
    return {r["id"] for r in await fetch_all(conn, names, "release", params)}
