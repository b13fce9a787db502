"""Retention, for `relay prune` and the scheduled prune of `relay start`: delete finished
rows older than a cutoff, a small chunk at a time.

The outbox keeps every delivered row as ``done`` until something deletes it. Prune walks
the primary key from the lowest id in chunks (``batch`` ids per statement, each statement
its own short transaction, so no lock is held for long and autovacuum can reclaim the
space between chunks), deleting ``done`` rows whose ``done_at`` is before the cutoff.

It stops at the first chunk whose rows were all created after the cutoff: a row is done
only after it was created, so no later id can qualify (ids follow creation order, up to
the length of a producer's transaction). So a run reads what it deletes plus at most one
chunk of what it keeps, however large the table.

Dead rows are kept unless ``include_dead`` is set; then the unordered ones created before
the cutoff go too. A dead **ordered** row is never deleted: it stops its aggregate (now,
or once it is the head), and deleting it would unblock the aggregate behind it and leave
a hole in ``aggregate_seq`` that nothing records. Prune counts them and names their
aggregates; with ``skip_blocking`` it skips them instead, exactly as ``relay dead skip``
does (done without delivery, who and why recorded), and they go with the done rows of a
later prune. Pending and processing rows are never touched.

With ``heads_idle_for``, prune also forgets the heads row (the ``aggregate_seq`` counter)
of every ordered aggregate with nothing unfinished that has numbered nothing for that
long, so ``<table>_heads`` does not keep a row for every aggregate ever seen; such an
aggregate starts again at ``aggregate_seq`` 1 if it comes back.

On a partitioned outbox (relay.db.partitions) nothing is deleted row by row: prune drops the
partitions whose every row qualifies by the same rule (done before the cutoff; with
``include_dead``, dead unordered rows created before it), and keeps, saying why, every
other one (a pending, processing or dead row, a row finished after the cutoff, a head),
as well as the partition holding the last id and those ahead of it. The dead ordered rows
are counted and skipped as above, and the heads forgotten as above.

Either way, with a ``payloads`` store, prune then deletes the claim-check's objects
(relay.claimcheck) whose rows have left history, and forgets them: an object is never
deleted while its row is in history, so a replay finds every payload it needs. Objects the
store would not delete (unreachable, no credentials) wait for the next prune, counted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from relay.db import history
from relay.db.history import BlockingDead
from relay.db.names import OutboxNames
from relay.db.partitions import PartitionsPruned, drop_finished, is_partitioned
from relay.db.rows import Conn
from relay.durations import format_duration
from relay.errors import ConfigError

log = logging.getLogger("relay.prune")

# Ids per statement: a chunk of 5,000 deletes in tens of milliseconds on ordinary
# hardware, short enough that producers and workers never queue behind it.
DEFAULT_BATCH = 5000
# Dead ordered rows skipped per transaction by skip_blocking (relay dead skip's own
# write, which locks the rows and moves their heads on).
SKIP_PAGE = 1000
# Aggregate ids a result names; the count says how many more.
SAMPLE = 20
# Prune forgets no heads while at least this many committed ordered rows wait to be
# numbered (relays stopped, or far behind): every chunk reads that backlog to know which
# aggregates are not idle, and a later prune does it once they have caught up.
WAITING_LIMIT = 10_000


class Skipped(Protocol):
    """What skipping a page of dead rows did: whether it was written, which rows it
    changed, and which it refused (a row re-driven meanwhile)."""

    @property
    def applied(self) -> bool: ...

    @property
    def changed(self) -> Sequence[Any]: ...

    @property
    def refused(self) -> Sequence[Any]: ...


# How a page of dead ordered rows is skipped: `relay dead skip`'s own write
# (relay.ops.deadletters.skip), handed in by the command, so that retention, which the
# running relay uses too, never depends on the operator tools.
Skip = Callable[..., Awaitable[Skipped]]


class PayloadStore(Protocol):
    """Where the claim-check's objects are deleted (relay.claimcheck.StoredPayloads)."""

    async def delete(self, refs: Sequence[str]) -> tuple[list[str], str | None]: ...


@dataclass(frozen=True)
class PayloadsResult:
    """What deleting the stored objects of rows that left history did (or would do)."""

    deleted: int  # objects deleted from the store and forgotten (in a dry run: that would be)
    waiting: int  # objects the store did not delete (``why``); the next prune tries again
    why: str | None = None


@dataclass(frozen=True)
class SkipBlocking:
    """Skip the dead ordered rows prune would otherwise keep, recorded as ``by`` with
    ``reason``, with ``skip`` (``skip(conn, names, ids, by=..., reason=...)``)."""

    by: str
    reason: str
    skip: Skip


@dataclass(frozen=True)
class HeadsResult:
    """What forgetting idle aggregates' heads did (or would do)."""

    idle_for: timedelta
    cutoff: datetime  # nothing numbered since this moment
    forgotten: int  # heads rows deleted (in a dry run: that would be)
    scanned: int  # heads rows read
    waiting: int  # committed ordered rows waiting to be numbered when it was put off; 0 otherwise

    @property
    def postponed(self) -> bool:
        return self.waiting >= WAITING_LIMIT


@dataclass(frozen=True)
class PruneResult:
    """What a prune run removed (or, with ``dry_run``, would remove)."""

    cutoff: datetime  # rows finished (done) or created (dead) before this qualified
    older_than: timedelta
    include_dead: bool
    dry_run: bool
    done: int  # done rows deleted
    dead: int  # dead unordered rows deleted (only with include_dead)
    batches: int  # statements issued
    scanned: int  # rows read across all chunks
    last_id: int | None  # the walk stopped after this id
    # With include_dead: the dead ordered rows before the cutoff, which block their
    # aggregates and were kept (or, with skip_blocking, skipped).
    blocking: BlockingDead | None = None
    skipped: int = 0  # of those, skipped (skip_blocking; in a dry run: would be)
    heads: HeadsResult | None = None
    # A partitioned outbox: the partitions dropped (their rows are counted in done and dead)
    # and kept; None for a plain outbox.
    partitions: PartitionsPruned | None = None
    # The claim-check's objects whose rows left history (None: there were none, or no store).
    payloads: PayloadsResult | None = None

    @property
    def deleted(self) -> int:
        return self.done + self.dead


async def prune(
    conn: Conn,
    names: OutboxNames,
    older_than: timedelta,
    *,
    include_dead: bool = False,
    skip_blocking: SkipBlocking | None = None,
    heads_idle_for: timedelta | None = None,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
    payloads: PayloadStore | None = None,
) -> PruneResult:
    """Delete done rows finished more than ``older_than`` ago, ``batch`` ids per statement.

    ``conn`` must be in autocommit mode (as :func:`relay.db.connect` opens it), so that each
    chunk commits on its own. ``dry_run`` counts what each chunk would delete instead.
    ``include_dead``: dead unordered rows created before the cutoff go too, and the dead
    ordered ones are counted (kept; skipped with ``skip_blocking``). ``heads_idle_for``:
    forget the heads of aggregates idle that long (see the module's docstring).
    ``payloads``: delete the claim-check's objects whose rows have left history from it.
    """
    if older_than < timedelta(0):
        raise ConfigError("invalid --older-than: must not be negative")
    if batch < 1:
        raise ConfigError(f"invalid batch size {batch}: must be at least 1")
    if skip_blocking is not None and not include_dead:
        raise ConfigError("--skip-blocking skips dead messages: give --include-dead with it")
    if skip_blocking is not None and not skip_blocking.reason.strip():
        raise ConfigError("--skip-blocking needs a reason: pass --reason TEXT (it is recorded with each message)")
    if heads_idle_for is not None and heads_idle_for < timedelta(0):
        raise ConfigError("invalid --heads-idle-for: must not be negative")
    if not conn.autocommit:
        raise ValueError("prune needs an autocommit connection: each chunk is its own transaction")
    cutoff = await history.prune_cutoff(conn, names, older_than)
    blocking, skipped = None, 0
    if include_dead:
        blocking = await history.prune_blocking_count(conn, names, cutoff, SAMPLE)
        if skip_blocking is not None and blocking.n:
            skipped = blocking.n if dry_run else await _skip_blocking(conn, names, cutoff, skip_blocking)
    if await is_partitioned(conn, names):
        dropped = await drop_finished(conn, names, cutoff, include_dead=include_dead, dry_run=dry_run)
        heads = None if heads_idle_for is None else await _forget_heads(conn, names, heads_idle_for, batch, dry_run)
        log.info(
            "%s %d partitions of %s (%d done and %d dead rows) older than %s; %d kept",
            "prune dry run: would drop" if dry_run else "pruned",
            len(dropped.dropped),
            names.qualified,
            dropped.done,
            dropped.dead,
            format_duration(older_than),
            len(dropped.kept) + dropped.more_kept,
        )
        return PruneResult(
            cutoff=cutoff,
            older_than=older_than,
            include_dead=include_dead,
            dry_run=dry_run,
            done=dropped.done,
            dead=dropped.dead,
            batches=0,
            scanned=0,
            last_id=None,
            blocking=blocking,
            skipped=skipped,
            heads=heads,
            partitions=dropped,
            payloads=await _forget_payloads(conn, names, payloads, batch, dry_run),
        )
    after, batches, scanned, done, dead = 0, 0, 0, 0, 0
    while True:
        chunk = await history.prune_chunk(
            conn, names, after_id=after, batch=batch, cutoff=cutoff, include_dead=include_dead, dry_run=dry_run
        )
        batches += 1
        scanned += chunk.scanned
        done += chunk.done
        dead += chunk.dead
        log.debug(
            "prune chunk %d: ids %d..%s, %d done and %d dead %s",
            batches,
            after + 1,
            chunk.last_id,
            chunk.done,
            chunk.dead,
            "would be deleted" if dry_run else "deleted",
        )
        if chunk.last_id is None or chunk.all_newer or chunk.scanned < batch:
            break
        after = chunk.last_id
    heads = None if heads_idle_for is None else await _forget_heads(conn, names, heads_idle_for, batch, dry_run)
    result = PruneResult(
        cutoff=cutoff,
        older_than=older_than,
        include_dead=include_dead,
        dry_run=dry_run,
        done=done,
        dead=dead,
        batches=batches,
        scanned=scanned,
        last_id=chunk.last_id or (after or None),
        blocking=blocking,
        skipped=skipped,
        heads=heads,
        payloads=await _forget_payloads(conn, names, payloads, batch, dry_run),
    )
    log.info(
        "%s %d done and %d dead rows of %s older than %s (%d batches)",
        "prune dry run: would delete" if dry_run else "pruned",
        done,
        dead,
        names.qualified,
        format_duration(older_than),
        batches,
    )
    return result


async def _forget_payloads(
    conn: Conn, names: OutboxNames, store: PayloadStore | None, batch: int, dry_run: bool
) -> PayloadsResult | None:
    """Delete from ``store`` the objects whose rows have left history, a page at a time,
    and forget them; stop at the first page the store refuses (counted as waiting)."""
    if store is None:
        return None
    after: history.PayloadsAt | None = history.PAYLOADS_START
    deleted, waiting, why = 0, 0, None
    while after is not None:
        after, refs = await history.payloads_unneeded(conn, names, after=after, batch=batch)
        if not refs:
            continue
        if dry_run:
            deleted += len(refs)
            continue
        gone, why = await store.delete(refs)
        if gone:
            await history.payloads_forget(conn, names, gone)
        deleted += len(gone)
        waiting += len(refs) - len(gone)
        if why is not None:
            log.warning(
                "prune: the claim-check store did not delete %d objects of rows that left history;"
                " the next prune tries again: %s",
                len(refs) - len(gone),
                why,
            )
            break
    if not deleted and not waiting:
        return None
    verb = "would delete" if dry_run else "deleted"
    log.info("%s %d stored payloads of rows that left %s", verb, deleted, names.qualified)
    return PayloadsResult(deleted, waiting, why)


async def _skip_blocking(conn: Conn, names: OutboxNames, cutoff: datetime, how: SkipBlocking) -> int:
    """Skip the dead ordered rows created before ``cutoff`` a page at a time, with relay dead
    skip's own write; returns how many were skipped. A row re-driven meanwhile (no longer
    dead) is left to its new life: the page goes without it."""
    after, skipped = 0, 0
    while ids := await history.prune_blocking_page(conn, names, cutoff, after, SKIP_PAGE):
        after = ids[-1]
        while ids:
            written = await how.skip(conn, names, ids, by=how.by, reason=how.reason)
            if written.applied:
                skipped += len(written.changed)
                break
            refused = {r.id for r in written.refused}
            ids = [i for i in ids if i not in refused]
    return skipped


async def _forget_heads(conn: Conn, names: OutboxNames, idle_for: timedelta, batch: int, dry_run: bool) -> HeadsResult:
    cutoff = await history.prune_cutoff(conn, names, idle_for)
    waiting = await history.prune_heads_waiting(conn, names, WAITING_LIMIT)
    if waiting >= WAITING_LIMIT:
        log.warning(
            "prune: %s or more ordered rows of %s wait to be numbered; idle aggregates are forgotten once the"
            " relays have caught up (a later prune)",
            f"{WAITING_LIMIT:,}",
            names.qualified,
        )
        return HeadsResult(idle_for, cutoff, 0, 0, waiting)
    after, forgotten, scanned = "", 0, 0
    while True:
        chunk = await history.prune_heads_chunk(conn, names, after=after, batch=batch, cutoff=cutoff, dry_run=dry_run)
        scanned += chunk.scanned
        forgotten += chunk.idle if dry_run else chunk.forgotten
        if chunk.last is None or chunk.scanned < batch:
            break
        after = chunk.last
    log.info(
        "%s the counters of %d ordered aggregates of %s idle for %s",
        "prune dry run: would forget" if dry_run else "forgot",
        forgotten,
        names.qualified,
        format_duration(idle_for),
    )
    return HeadsResult(idle_for, cutoff, forgotten, scanned, 0)
