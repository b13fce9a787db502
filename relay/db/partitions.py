"""A partitioned outbox: range partitions by id or by created_at (time), created ahead of the
producers and dropped whole once every row in them is finished.

Why: at high rates, deleting done rows one by one (relay.retention) leaves millions of dead
tuples for vacuum to reclaim, and some servers run with autovacuum off. Dropping a partition
removes its rows, their index entries and their space in one catalog change.

Three duties, each safe to run from several processes at once:

* :func:`partition_outbox` (``relay migrate --partition-by id|time``) turns an **empty** plain
  outbox into a partitioned one, in the migration's transaction: a non-empty table cannot be
  converted online (docs/partitioning.md gives the way over).
* :func:`keep_ahead` creates the partitions the next ids will need, ``ahead`` beyond the one
  the next id goes to (there is no DEFAULT partition, so an id without a partition fails its
  INSERT). It calls ``<table>_keep_ahead()``, which runs as the owner, so the relays' role
  (no DDL) can run it; `relay migrate` runs it, and so should one elected relay.
* :func:`drop_finished` (``relay prune`` on a partitioned outbox) drops the partitions below
  the one holding the last id whose every row is finished under prune's history rule, with
  ``DETACH ... CONCURRENTLY`` (producers and relays go on), then a check of the detached
  table under its lock, then ``DROP``; a partition that received a row while it was being
  detached is attached again instead. The ingest's turn is held throughout (ordered numbering
  pauses for as long as the detach waits for the transactions using the outbox).

By time, the same three duties with another meaning of "current": partitions hold created_at
ranges aligned to the span from the epoch; the one holding now() and those after it are where
producers write. The primary key is then (id, created_at) (a unique constraint of a
partitioned table must hold its partition key); ids stay unique by the identity.
"""

from __future__ import annotations

import logging
import string
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from psycopg import sql
from psycopg.rows import dict_row

from relay.db.names import OutboxNames
from relay.db.rows import Conn, Row, fetch_all, fetch_one
from relay.db.session import connect_beside
from relay.db.statements import named_partition_ddl, statement
from relay.errors import ConfigError

log = logging.getLogger("relay.db.partitions")

# Partitions kept beyond the one the next id goes to, unless `relay migrate --partitions-ahead`
# says otherwise. With keep_ahead run every minute by the elected relay, 4 partitions of
# 1,000,000 ids leave room for 4 million inserts while no relay runs.
DEFAULT_AHEAD = 4
# Kept partitions a prune result names one by one; the rest are counted.
SAMPLE = 20
# The privileges a conversion grants again (what aclexplode reports for a table or column).
_PRIVILEGES = frozenset({"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"})


@dataclass(frozen=True)
class Ahead:
    """What :func:`keep_ahead` found and did."""

    partitioned: bool
    created: tuple[str, ...] = ()
    next_id: int | None = None  # the id the next insert gets (the identity's next value)
    covered_to: int | None = None  # by id: the first id with no partition: inserts fail from there
    covered_until: datetime | None = None  # by time: the first instant with no partition

    @property
    def room(self) -> int | None:
        """Ids that can still be inserted before one finds no partition."""
        if self.next_id is None or self.covered_to is None:
            return None
        return self.covered_to - self.next_id


async def is_partitioned(conn: Conn, names: OutboxNames) -> bool:
    """Whether the outbox ``names`` is a partitioned table (any role may ask)."""
    rows = await fetch_all(conn, names, "partition_kind", {"schema": names.schema, "table": names.table})
    return bool(rows and rows[0]["partitioned"])


async def keep_ahead(conn: Conn, names: OutboxNames) -> Ahead:
    """Create the partitions a partitioned outbox lacks (the one the next id goes to and
    ``ahead`` beyond it); nothing for a plain outbox. Idempotent; concurrent callers take
    turns. ``conn`` in autocommit mode: the creation commits on its own."""
    if not await is_partitioned(conn, names):
        return Ahead(partitioned=False)
    r = await fetch_one(conn, names, "partition_keep_ahead")
    made = tuple(r["created"] or ())
    if made:
        log.info("%s: created partitions %s", names.qualified, ", ".join(made))
    return _ahead(r, made)


def _ahead(r: Row, made: tuple[str, ...]) -> Ahead:
    return Ahead(bool(r["partitioned"]), made, r["next_id"], r["covered_to"], r["covered_until"])


# ---- creating a partitioned outbox


# By time, partitions are named by their start to the hour (<table>_pYYYYMMDDHH, or
# <table>_pYYYYMMDD for whole days): 40 characters of table name, the suffix and "_in_flight"
# fit PostgreSQL's 63 bytes, and whole hours keep every name distinct.
MIN_SPAN = timedelta(hours=1)
MAX_SPAN = timedelta(days=366)


@dataclass(frozen=True)
class PartitionSpec:
    """``relay migrate --partition-by id --partition-size N --partitions-ahead K`` or
    ``--partition-by time --partition-interval 1d --partitions-ahead K`` (``span`` given)."""

    size: int | None = None
    ahead: int = DEFAULT_AHEAD
    span: timedelta | None = None

    def __post_init__(self) -> None:
        if (self.size is None) == (self.span is None):
            raise ConfigError("an outbox is partitioned by id (a size) or by time (an interval): one of them")
        if self.size is not None and self.size < 1:
            raise ConfigError(f"invalid --partition-size {self.size}: at least 1 id per partition")
        if self.span is not None and (
            self.span < MIN_SPAN or self.span > MAX_SPAN or self.span % MIN_SPAN != timedelta(0)
        ):
            raise ConfigError(
                f"invalid --partition-interval {self.span / MIN_SPAN:g}h: a whole number of hours, from 1h to 366d"
            )
        if self.ahead < 1:
            raise ConfigError(f"invalid --partitions-ahead {self.ahead}: at least 1")

    @property
    def key(self) -> str:
        return "time" if self.span is not None else "id"

    def describe(self) -> str:
        if self.span is not None:
            return f"by time, {span_text(self.span)} per partition"
        return f"by id, {self.size:,} ids per partition"


def span_text(span: timedelta) -> str:
    """A partition's span as --partition-interval takes it: ``7d``, ``36h``."""
    day = timedelta(days=1)
    return f"{span // day}d" if span % day == timedelta(0) else f"{span // MIN_SPAN}h"


def _stored(row: Row) -> PartitionSpec:
    return PartitionSpec(size=row["size"], ahead=row["ahead"], span=row["span"])


@dataclass(frozen=True)
class Partitioned:
    """What :func:`partition_outbox` did: ``converted`` (the plain table was replaced now) or
    found it partitioned already; the partitions kept ahead."""

    converted: bool
    spec: PartitionSpec
    partitions: Ahead

    @property
    def size(self) -> int | None:
        return self.spec.size

    @property
    def ahead(self) -> int:
        return self.spec.ahead


async def partition_outbox(conn: Conn, names: OutboxNames, spec: PartitionSpec) -> Partitioned:
    """Make the outbox ``names`` partitioned by id or by time as ``spec`` says, inside the
    caller's transaction (`relay migrate`'s, under its advisory lock, after the migrations): an
    empty plain outbox is replaced by a partitioned one; a partitioned one keeps its key and
    its size or interval (another is refused) and takes the new ``ahead``. Refuses a plain
    outbox that holds rows, changing nothing."""
    if not await is_partitioned(conn, names):
        await _convert(conn, names, spec)
        converted = True
    else:
        rows = await fetch_all(conn, names, "partition_config")
        if rows:
            _refuse_change(names, _stored(rows[0]), spec)
        converted = False
    await conn.execute(
        statement(names, "partition_config_write"),
        {"key": spec.key, "size": spec.size, "span": spec.span, "ahead": spec.ahead},
    )
    r = await fetch_one(conn, names, "partition_keep_ahead")
    return Partitioned(converted, spec, _ahead(r, tuple(r["created"] or ())))


def _refuse_change(names: OutboxNames, stored: PartitionSpec, spec: PartitionSpec) -> None:
    """One line when ``spec`` asks for another key, size or interval than the outbox has:
    its partitions already hold rows by the stored one."""
    if stored.key != spec.key:
        raise ConfigError(
            f"{names.qualified} is partitioned {stored.describe()}; --partition-by {spec.key} cannot change that"
            " (its partitions already hold rows by the other key)"
        )
    if stored.size != spec.size:
        assert stored.size is not None and spec.size is not None
        raise ConfigError(
            f"{names.qualified} is partitioned by {stored.size:,} ids per partition; --partition-size"
            f" {spec.size:,} cannot change that (partitions already hold ids by it)"
        )
    if stored.span != spec.span:
        assert stored.span is not None and spec.span is not None
        raise ConfigError(
            f"{names.qualified} is partitioned by time, {span_text(stored.span)} per partition;"
            f" --partition-interval {span_text(spec.span)} cannot change that (partitions already hold"
            " rows by it)"
        )


async def _convert(conn: Conn, names: OutboxNames, spec: PartitionSpec) -> None:
    await conn.execute(statement(names, "partition_convert_lock"))
    state = await fetch_one(conn, names, "partition_convert_state")
    if state["has_rows"]:
        raise ConfigError(
            f"cannot partition {names.qualified}: it holds rows, and a table that holds rows cannot be"
            " converted online; create a partitioned outbox beside it (another --table) and move the producers"
            " over (docs/partitioning.md, 'An existing outbox')"
        )
    grants = await fetch_all(conn, names, "partition_convert_grants")
    table = "partition_convert_table_time" if spec.key == "time" else "partition_convert_table"
    await conn.execute(statement(names, table))
    [sequence] = await fetch_all(conn, names, "partition_convert_sequence")
    wanted = f"{names.table}_id_seq"
    if sequence["name"] != wanted:
        await conn.execute(
            sql.SQL("ALTER SEQUENCE {} RENAME TO {}").format(
                sql.Identifier(names.schema, sequence["name"]), sql.Identifier(wanted)
            )
        )
    # Ids go on from the plain table's: heads (last_id), epochs and consumers remember them.
    start = int(state["last_id"] or 0) + 1
    await conn.execute(
        sql.SQL("ALTER TABLE {} ALTER COLUMN id RESTART WITH {}").format(names.identifier("outbox"), sql.Literal(start))
    )
    await conn.execute(statement(names, "partition_convert_objects"))
    if state["commit_order"] == "id":
        await conn.execute(statement(names, "partition_convert_commit_order_id"))
    for g in grants:
        await _grant_again(conn, names, g)


async def _grant_again(conn: Conn, names: OutboxNames, g: Row) -> None:
    privilege = g["privilege_type"]
    if privilege not in _PRIVILEGES:  # what aclexplode reports for tables: nothing else
        raise ConfigError(f"cannot carry privilege {privilege!r} on {names.qualified} over to the partitioned table")
    column = sql.SQL(" ({})").format(sql.Identifier(g["column_name"])) if g["column_name"] else sql.SQL("")
    grantee = sql.SQL("PUBLIC") if g["public"] else sql.Identifier(g["grantee"])
    option = sql.SQL(" WITH GRANT OPTION") if g["is_grantable"] else sql.SQL("")
    await conn.execute(
        sql.SQL("GRANT {}{} ON {} TO {}{}").format(
            sql.SQL(privilege), column, names.identifier("outbox"), grantee, option
        )
    )


# ---- retention by the partition


# A partition's bounds: ids [lo, hi) by id, created_at [lo, hi) by time.
Bound = int | datetime


# The bounds partition_rows leaves open: every id, every time.
_ANY_ID = (-(2**63), 2**63 - 1)
_ANY_TIME = ("-infinity", "infinity")


def _row_bounds(lo: Bound, hi: Bound, by_time: bool) -> dict[str, Any]:
    """partition_rows' parameters for the partition [lo, hi): its key's bounds, the other
    key's left open."""
    if by_time:
        return {"lo_id": _ANY_ID[0], "hi_id": _ANY_ID[1], "lo_at": lo, "hi_at": hi}
    return {"lo_id": lo, "hi_id": hi, "lo_at": _ANY_TIME[0], "hi_at": _ANY_TIME[1]}


def bounds_text(lo: Bound, hi: Bound) -> str:
    """A partition's bounds for people: ``ids 20..39`` or ``created 2026-12-04 00:00..2026-12-05 00:00 UTC``."""
    if isinstance(lo, datetime) and isinstance(hi, datetime):
        a, b = lo.astimezone(UTC), hi.astimezone(UTC)
        return f"created {a:%Y-%m-%d %H:%M}..{b:%Y-%m-%d %H:%M} UTC"
    assert isinstance(lo, int) and isinstance(hi, int)
    return f"ids {lo}..{hi - 1}"


@dataclass(frozen=True)
class DroppedPartition:
    name: str
    lo: Bound  # ids [lo, hi), or created_at [lo, hi) by time
    hi: Bound
    done: int  # done rows it held
    dead: int  # dead unordered rows it held (only with include_dead)


@dataclass(frozen=True)
class KeptPartition:
    name: str
    lo: Bound
    hi: Bound
    why: str  # one line: "2 pending rows (ids 12..40)", "current", ...


@dataclass(frozen=True)
class PartitionsPruned:
    """What dropping partitions did (``dry_run``: would do): those dropped, those kept and
    why (the first :data:`SAMPLE` by name, the rest counted in ``more_kept``)."""

    dropped: tuple[DroppedPartition, ...]
    kept: tuple[KeptPartition, ...]
    more_kept: int = 0
    refused: str | None = None  # why nothing could be dropped at all (not the owner, another prune)

    @property
    def done(self) -> int:
        return sum(p.done for p in self.dropped)

    @property
    def dead(self) -> int:
        return sum(p.dead for p in self.dropped)


def _render(names: OutboxNames, name: str, partition: str) -> sql.Composed:
    """The named statement ``name`` of sql/partition_ddl.sql with ``{partition}`` standing
    for the partition ``partition`` of the outbox's schema (a name from the catalog)."""
    text = named_partition_ddl()[name]
    keys = {key for _, key, _, _ in string.Formatter().parse(text) if key}
    filled = {
        key: sql.Identifier(names.schema, partition) if key == "partition" else names.identifier(key) for key in keys
    }
    return sql.SQL(text).format(**filled)


def _ids(n: int, lo: int | None, hi: int | None) -> str:
    return f"id {lo}" if n == 1 or lo == hi else f"ids {lo}..{hi}"


def _why_kept(r: Row) -> str | None:
    """Why a partition's rows keep it (bounded: counts and id ranges), or None."""
    reasons = []
    for key, noun in (("pending", "pending"), ("processing", "processing"), ("blocking", "dead")):
        n = r[key]
        if n:
            reasons.append(f"{n:,} {noun} row{'s' if n != 1 else ''} ({_ids(n, r[key + '_from'], r[key + '_to'])})")
    n = r["recent"]
    if n:
        reasons.append(
            f"{n:,} row{'s' if n != 1 else ''} finished after the cutoff ({_ids(n, r['recent_from'], r['recent_to'])})"
        )
    return ", ".join(reasons) or None


async def drop_finished(
    conn: Conn, names: OutboxNames, cutoff: datetime, *, include_dead: bool, dry_run: bool
) -> PartitionsPruned:
    """Drop (``dry_run``: name) the partitions of the outbox ``names`` whose every row is
    finished before ``cutoff`` by prune's rule: done before it, or with ``include_dead`` dead,
    unordered and created before it. Never the partition holding the last id handed out (by
    time: now) nor any after it, nor one holding a head. ``conn`` in autocommit mode."""
    kind = await fetch_all(conn, names, "partition_kind", {"schema": names.schema, "table": names.table})
    if not kind or not kind[0]["owner"]:
        return PartitionsPruned(
            (), (), refused="only the outbox's owner may drop its partitions: run relay prune as it"
        )
    turn = await fetch_one(conn, names, "partition_prune_turn")
    if not turn["taken"]:
        return PartitionsPruned((), (), refused="another relay prune is dropping partitions of this outbox")
    try:
        if dry_run:
            return await _drop_finished(conn, None, names, cutoff, include_dead=include_dead)
        async with await connect_beside(conn) as ingest:
            return await _drop_finished(conn, ingest, names, cutoff, include_dead=include_dead)
    finally:
        await conn.execute(statement(names, "partition_prune_turn_end"))


async def _drop_finished(
    conn: Conn, ingest: Conn | None, names: OutboxNames, cutoff: datetime, *, include_dead: bool
) -> PartitionsPruned:
    """``ingest``: the connection that holds the ingest's turn while a partition is
    detached (see :func:`_detach_and_drop`); None for a dry run, which detaches nothing."""
    params: dict[str, Any] = {"cutoff": cutoff, "include_dead": include_dead}
    dropped: list[DroppedPartition] = []
    kept: list[KeptPartition] = []
    config = await fetch_all(conn, names, "partition_config")
    spec = _stored(config[0]) if config else None
    by_time = spec is not None and spec.key == "time"
    if ingest is not None and spec is not None:
        dropped += await _orphans(conn, ingest, names, spec, params, kept)
    parts = await fetch_all(conn, names, "partition_list_time" if by_time else "partition_list")
    if ingest is not None:
        for p in parts:
            if p["detaching"]:  # an interrupted DETACH ... CONCURRENTLY: finish it, then decide
                gone = await _detach_and_drop(
                    conn, ingest, names, "partition_detach_finalize", p["name"], p["lo"], p["hi"], params, kept
                )
                dropped += [gone] if gone else []
        parts = [p for p in parts if not p["detaching"]]
    # The partition holding the last id handed out (by time: now), and every one after it,
    # are where producers write: never candidates.
    last: Bound | None = (parts[0]["now"] if by_time else parts[0]["last_id"]) if parts else None
    current = next((p["lo"] for p in parts if last is not None and p["lo"] <= last < p["hi"]), None)
    candidates = [p for p in parts if last is not None and p["hi"] <= (current if current is not None else last)]
    later = [p for p in parts if p not in candidates]
    heads = {
        r["lo"]: r["heads"]
        for r in await fetch_all(
            conn, names, "partition_heads_time" if by_time else "partition_heads",
            {"los": [p["lo"] for p in candidates], "his": [p["hi"] for p in candidates]},
        )
    } if candidates else {}  # fmt: skip
    newer_from: int | None = None
    for p in candidates:
        if newer_from is not None:
            kept.append(KeptPartition(p["name"], p["lo"], p["hi"], "newer than the cutoff"))
            continue
        r = await fetch_one(conn, names, "partition_rows", {**params, **_row_bounds(p["lo"], p["hi"], by_time)})
        why = _why_kept(r)
        if heads.get(p["lo"]):
            n = heads[p["lo"]]
            why = ", ".join(filter(None, [why, f"head of {n:,} aggregate{'s' if n != 1 else ''}"]))
        if r["newer"]:
            # Ids follow creation (and time partitions are creation): the partitions after
            # this one hold rows created later still, all after the cutoff; they are not read.
            newer_from = p["lo"]
        if why is not None:
            kept.append(KeptPartition(p["name"], p["lo"], p["hi"], why))
            continue
        if ingest is None:
            dropped.append(DroppedPartition(p["name"], p["lo"], p["hi"], r["done"], r["dead"]))
            continue
        gone = await _detach_and_drop(
            conn, ingest, names, "partition_detach", p["name"], p["lo"], p["hi"], params, kept
        )
        dropped += [gone] if gone else []
    for p in later:
        if by_time:
            what = "holds now" if p["lo"] == current else "ahead of now"
        else:
            what = "holds the last id handed out" if p["lo"] == current else "ahead of the last id"
        kept.append(KeptPartition(p["name"], p["lo"], p["hi"], what))
    return PartitionsPruned(tuple(dropped), tuple(kept[:SAMPLE]), max(0, len(kept) - SAMPLE))


async def _detach_and_drop(
    conn: Conn,
    ingest: Conn,
    names: OutboxNames,
    detach: str | None,
    name: str,
    lo: Bound,
    hi: Bound,
    params: dict[str, Any],
    kept: list[KeptPartition],
) -> DroppedPartition | None:
    """Detach the partition ``name`` by the statement ``detach`` (None: it is detached
    already), then drop it or attach it again (:func:`_drop_detached`), holding the
    ingest's turn on ``ingest`` throughout.

    Why the turn: a producer transaction that drew an id in the partition before its rows
    were read may commit while it is detached. DETACH ... CONCURRENTLY waits for it, and
    the re-check finds its row and attaches the partition again; but meanwhile the row is
    invisible to an ingest, which would consume the transaction's commit stamp and number
    the transactions committed after it first: the row would be numbered out of commit
    order, or not at all while stamps keep coming. Held, the relays' ingests skip their turn
    for that long (the time the detach waits for the transactions using the outbox), and
    claim on."""
    async with ingest.transaction():
        await ingest.execute(statement(names, "partition_ingest_turn"))
        if detach is not None:
            await conn.execute(_render(names, detach, name))
        return await _drop_detached(conn, names, name, lo, hi, params, kept)


async def _drop_detached(
    conn: Conn,
    names: OutboxNames,
    name: str,
    lo: Bound,
    hi: Bound,
    params: dict[str, Any],
    kept: list[KeptPartition],
) -> DroppedPartition | None:
    """Drop the detached partition ``name`` if its rows, read under its lock, are all still
    finished; else attach it again as [lo, hi) and say so in ``kept``."""
    async with conn.transaction():
        await conn.execute(_render(names, "partition_lock", name))
        cur = conn.cursor(row_factory=dict_row)
        await cur.execute(_render(names, "partition_detached_rows", name), params)
        r = await cur.fetchone()
        assert r is not None
        if not r["unfinished"]:
            await conn.execute(_render(names, "partition_drop", name))
            log.info("%s: dropped partition %s (%s, %d rows)", names.qualified, name, bounds_text(lo, hi), r["rows"])
            return DroppedPartition(name, lo, hi, r["done"], r["dead"])
        await conn.execute(
            sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                names.identifier("outbox"), sql.Identifier(names.schema, name), sql.Literal(lo), sql.Literal(hi)
            )
        )
    n = r["unfinished"]
    why = f"attached again: {n:,} unfinished row{'s' if n != 1 else ''} arrived while it was being detached"
    log.warning("%s: partition %s %s", names.qualified, name, why)
    kept.append(KeptPartition(name, lo, hi, why))
    return None


async def _orphans(
    conn: Conn,
    ingest: Conn,
    names: OutboxNames,
    spec: PartitionSpec,
    params: dict[str, Any],
    kept: list[KeptPartition],
) -> list[DroppedPartition]:
    """Partitions an interrupted prune detached and did not drop: dropped now if finished,
    else attached again at the bounds their number (by time: their start) gives."""
    orphans = await fetch_all(conn, names, "partition_orphans", {"schema": names.schema, "table": names.table})
    out = []
    for o in orphans:
        lo: Bound
        hi: Bound
        if spec.span is not None:
            digits = o["name"][len(names.table) + 2 :]
            if len(digits) not in (8, 10):
                continue  # not a name keep_ahead gives by time
            lo = datetime.strptime(digits.ljust(10, "0"), "%Y%m%d%H").replace(tzinfo=UTC)
            hi = lo + spec.span
        else:
            assert spec.size is not None
            lo = int(o["number"]) * spec.size
            hi = lo + spec.size
        gone = await _detach_and_drop(conn, ingest, names, None, o["name"], lo, hi, params, kept)
        out += [gone] if gone else []
    return out
