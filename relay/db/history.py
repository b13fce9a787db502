"""Retention: done rows deleted a chunk at a time, and the counters of idle ordered
aggregates forgotten (relay.retention decides what and when; `relay prune` and the
scheduled prune run it)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from relay.db.names import OutboxNames
from relay.db.rows import Conn, Row, fetch_all, fetch_one
from relay.db.statements import statement


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
    cutoff: datetime = (await fetch_one(conn, names, "prune_cutoff", {"older_than": older_than}))["cutoff"]
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
    return PruneChunk.from_row(await fetch_one(conn, names, "prune_chunk_count" if dry_run else "prune_chunk", params))


@dataclass(frozen=True)
class BlockingDead:
    """The dead ordered rows created before a prune's cutoff: how many, of how many
    aggregates, and the first aggregate ids by name."""

    n: int
    aggregates: int
    sample: tuple[str, ...]


async def prune_blocking_count(conn: Conn, names: OutboxNames, cutoff: datetime, sample: int) -> BlockingDead:
    """Count the dead ordered rows created before ``cutoff``; ``sample`` aggregate ids."""
    r = await fetch_one(conn, names, "prune_blocking_count", {"cutoff": cutoff, "sample": sample})
    return BlockingDead(r["n"], r["aggregates"], tuple(r["sample"]))


async def prune_blocking_page(conn: Conn, names: OutboxNames, cutoff: datetime, after_id: int, batch: int) -> list[int]:
    """Ids of the next ``batch`` dead ordered rows created before ``cutoff``, after ``after_id``."""
    rows = await fetch_all(conn, names, "prune_blocking_page", {"cutoff": cutoff, "after_id": after_id, "batch": batch})
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
        await conn.execute(statement(names, "prune_heads_turn"))
        params = {"after": after, "batch": batch, "cutoff": cutoff, "dry_run": dry_run}
        r = await fetch_one(conn, names, "prune_heads_chunk", params)
    return HeadsChunk(r["scanned"], r["last"], r["idle"], r["forgotten"])


async def prune_heads_waiting(conn: Conn, names: OutboxNames, limit: int) -> int:
    """Committed ordered rows waiting to be numbered, counted up to ``limit``."""
    n: int = (await fetch_one(conn, names, "prune_heads_waiting", {"limit": limit}))["n"]
    return n


# Where a walk of <table>_payloads stands: the last (outbox id, reference) read.
PayloadsAt = tuple[int, str]
PAYLOADS_START: PayloadsAt = (-(2**63), "")


async def payloads_unneeded(
    conn: Conn, names: OutboxNames, *, after: PayloadsAt, batch: int
) -> tuple[PayloadsAt | None, list[str]]:
    """Of the next ``batch`` stored objects in the outbox's id order after ``after``, those
    whose row has left history; and where the walk stands (None: nothing is left to read)."""
    params = {"after_id": after[0], "after_ref": after[1], "batch": batch}
    r = await fetch_one(conn, names, "payloads_unneeded", params)
    at = None if r["last_id"] is None else (int(r["last_id"]), str(r["last_ref"]))
    return at, list(r["gone"] or ())


async def payloads_forget(conn: Conn, names: OutboxNames, refs: list[str]) -> None:
    """Forget the objects ``refs``, deleted from the store, unless a row took one over meanwhile."""
    # Not prepared: a generic plan cannot see how many references the array holds, and may
    # scan the whole table for them (141 s for 1,000,000 objects, pages of 5,000).
    await conn.execute(statement(names, "payloads_forget"), {"refs": refs}, prepare=False)
