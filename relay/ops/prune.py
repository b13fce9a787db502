"""`relay prune`: delete finished rows older than a cutoff, a small chunk at a time.

The outbox keeps every delivered row as ``done`` until something deletes it. Prune walks
the primary key from the lowest id in chunks (``batch`` ids per statement, each statement
its own short transaction, so no lock is held for long and autovacuum can reclaim the
space between chunks), deleting ``done`` rows whose ``done_at`` is before the cutoff.

It stops at the first chunk whose rows were all created after the cutoff: a row is done
only after it was created, so no later id can qualify (ids follow creation order, up to
the length of a producer's transaction). So a run reads what it deletes plus at most one
chunk of what it keeps, however large the table.

Dead rows are kept unless ``include_dead`` is set; then those created before the cutoff
go too. Pending and processing rows are never touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from relay.durations import format_duration
from relay.errors import ConfigError
from relay.ops import queries
from relay.ops.queries import Conn
from relay.sqlnames import OutboxNames

log = logging.getLogger("relay.prune")

# Ids per statement: a chunk of 5,000 deletes in tens of milliseconds on ordinary
# hardware, short enough that producers and workers never queue behind it.
DEFAULT_BATCH = 5000


@dataclass(frozen=True)
class PruneResult:
    """What a prune run removed (or, with ``dry_run``, would remove)."""

    cutoff: datetime  # rows finished (done) or created (dead) before this qualified
    older_than: timedelta
    include_dead: bool
    dry_run: bool
    done: int  # done rows deleted
    dead: int  # dead rows deleted (only with include_dead)
    batches: int  # statements issued
    scanned: int  # rows read across all chunks
    last_id: int | None  # the walk stopped after this id

    @property
    def deleted(self) -> int:
        return self.done + self.dead


async def prune(
    conn: Conn,
    names: OutboxNames,
    older_than: timedelta,
    *,
    include_dead: bool = False,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
) -> PruneResult:
    """Delete done rows finished more than ``older_than`` ago, ``batch`` ids per statement.

    ``conn`` must be in autocommit mode (as :func:`relay.db.connect` opens it), so that each
    chunk commits on its own. ``dry_run`` counts what each chunk would delete instead.
    """
    if older_than < timedelta(0):
        raise ConfigError("invalid --older-than: must not be negative")
    if batch < 1:
        raise ConfigError(f"invalid batch size {batch}: must be at least 1")
    if not conn.autocommit:
        raise ValueError("prune needs an autocommit connection: each chunk is its own transaction")
    cutoff = await queries.prune_cutoff(conn, names, older_than)
    after, batches, scanned, done, dead = 0, 0, 0, 0, 0
    while True:
        chunk = await queries.prune_chunk(
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
