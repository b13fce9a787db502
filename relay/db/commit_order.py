"""How the ingest learns commit order, per outbox: ``stamp`` (the default) or ``id``.

``stamp`` is right for any producer: a deferred trigger draws a commit stamp for every
producer transaction that writes ordered rows, and the ingest numbers each aggregate's
rows by stamp (sql/schema.sql, "Ordered delivery"). It costs each such transaction a row
in ``<table>_commits``: about 15% of a single-row transaction's rate (BENCHMARKS.md).

``id`` is for producers that lock the aggregate (``SELECT ... FOR UPDATE`` on its row, or
an advisory lock on its id) before they insert its events: each event's id is then drawn
under the lock, so within an aggregate id order is commit order and no stamp is needed.
The stamp trigger is off and ``<table>_fresh_idx`` indexes waiting rows by id, so the
ingest takes them in id order. A producer that inserts before it locks, or does not lock
at all, breaks it: an aggregate's events may then reach consumers in id order rather than
commit order. The ingest sees one kind of breach, a row that becomes visible after a later
id of its aggregate was numbered, and the relay logs it (``late`` in the ingest's result).

:func:`switch` changes the mode of one outbox in one transaction, as the table's owner:
it takes the ingest's turn, locks the outbox (waiting for the producer transactions in
flight; reads and writes of the outbox wait for it meanwhile), numbers everything committed
by the old rule, then turns the trigger on or off and rebuilds the index (a scan of the
table: scripts/bench_producer.py --switch measures it).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal

import psycopg
from psycopg import errors, sql

from relay.db.names import OutboxNames
from relay.db.statements import named_queries, statement
from relay.errors import ConfigError

log = logging.getLogger("relay.db.commit_order")

CommitOrder = Literal["stamp", "id"]

# How long a switch waits for the producers' transactions in flight (and the relays'
# claims) to release the outbox before it gives up, changing nothing.
LOCK_TIMEOUT = timedelta(seconds=30)
# Committed transactions one turn of the switch's numbering takes (relay.db.dispatch's
# INGEST_TRANSACTIONS; the switch repeats turns until nothing is left).
TURN_TRANSACTIONS = 5000

# The two places where the ingest orders rows that carry no stamp: the turn's rows taken
# from the fresh index, and each aggregate's rows ranked for numbering. By transaction,
# then id, under 'stamp' (rows inserted with the triggers off); by id alone under 'id'.
_BY_TRANSACTION = ("      ORDER BY o.xid, o.id\n      LIMIT", "ORDER BY f.stamp, f.xid, f.id")
_BY_ID = ("      ORDER BY o.id\n      LIMIT", "ORDER BY f.stamp, f.id")


def ingest_by_id(text: str) -> str:
    """The ingest statement ``text`` (sql/queries.sql, ``ingest``) for ``--commit-order id``."""
    for old, new in zip(_BY_TRANSACTION, _BY_ID, strict=True):
        if text.count(old) != 1:
            raise ValueError(f"the ingest statement no longer reads {old!r} exactly once")
        text = text.replace(old, new)
    return text


def _ingest_statements(names: OutboxNames) -> dict[str, sql.Composed]:
    return {
        "plans": statement(names, "ingest_plans"),
        "plans_reset": statement(names, "ingest_plans_reset"),
        "stamp": statement(names, "ingest"),
        "id": names.render(ingest_by_id(named_queries()["ingest"])),
    }


async def switch(conn: psycopg.AsyncConnection[Any], names: OutboxNames, old: CommitOrder, new: CommitOrder) -> int:
    """Put the outbox ``names`` in ``new`` mode, inside the caller's transaction (which
    also writes the setting); returns how many rows were numbered first. The caller holds
    the settings row's lock; ``old`` is the mode stored there."""
    if old == new:
        return 0
    statements = _ingest_statements(names)
    fresh_idx = sql.Identifier(names.schema, f"{names.table}_fresh_idx")
    table = names.render("{outbox}")
    try:
        await conn.execute(
            sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{int(LOCK_TIMEOUT.total_seconds())}s"))
        )
        # The ingest's turn first, then the table (a relay's claim holds the table and only
        # tries the turn, skipping it when taken: the two orders cannot deadlock).
        await conn.execute(names.render("SELECT 1 FROM {q_ingest} FOR UPDATE"))
        # ACCESS EXCLUSIVE from the start: DROP INDEX takes it anyway, and taking a weaker
        # lock first would make this an upgrade, which can deadlock with a reader.
        await conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(table))
        # Everything committed so far, numbered by the rule it was written under: no
        # producer transaction is in flight now, so nothing stamped or unstamped arrives
        # after the switch that belongs before it.
        numbered = 0
        await conn.execute(statements["plans"])
        while True:
            cur = await conn.execute(statements[old], {"transactions": TURN_TRANSACTIONS})
            row = await cur.fetchone()
            assert row is not None
            numbered += int(row[1])
            if not row[0] or not row[1]:  # nothing left (or nothing it could number: no loop)
                break
        await conn.execute(statements["plans_reset"])
        trigger = sql.Identifier(f"{names.table}_stamp")
        columns = sql.SQL("id") if new == "id" else sql.SQL("xid, id")
        await conn.execute(sql.SQL("DROP INDEX {}").format(fresh_idx))
        await conn.execute(
            sql.SQL(
                "CREATE INDEX {} ON {} ({}) WHERE ordered AND aggregate_seq IS NULL AND status IN ('pending', 'dead')"
            ).format(sql.Identifier(f"{names.table}_fresh_idx"), table, columns)
        )
        state = sql.SQL("DISABLE") if new == "id" else sql.SQL("ENABLE")
        await conn.execute(sql.SQL("ALTER TABLE {} {} TRIGGER {}").format(table, state, trigger))
    except errors.InsufficientPrivilege as exc:
        raise ConfigError(
            f"--commit-order changes {names.qualified}'s trigger and index: run it as the table's owner"
            f" (the role `relay migrate` runs as); the database said: {exc.diag.message_primary}"
        ) from None
    except errors.LockNotAvailable:
        raise ConfigError(
            f"--commit-order waited {int(LOCK_TIMEOUT.total_seconds())} s for the transactions writing"
            f" {names.qualified} to finish and gave up; nothing changed (a long transaction holds the table:"
            " pg_stat_activity shows it)"
        ) from None
    log.info("%s: commit order %s -> %s (%d rows numbered by the old rule first)", names.qualified, old, new, numbered)
    return numbered
