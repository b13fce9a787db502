"""How the benchmarks watch a relay drain an outbox: statements cheap enough to poll every
few milliseconds while the relay is timed.

A count of the pending rows is a scan of the whole table each time: polled every 20 ms
during an ordered drain it took as much of PostgreSQL as the drain's own claims
(pg_stat_statements), and the relay's rate was measured against a database it shared
with its own stopwatch. These are probes of the relay's partial indexes instead.
"""

from __future__ import annotations

from psycopg import sql


def moving(table: sql.Identifier) -> sql.Composed:
    """True once a claim has leased a row: the clock starts."""
    return sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE status = 'processing')").format(table)


def waiting(table: sql.Identifier) -> sql.Composed:
    """True while a row is leased or waits to be: the clock stops when it turns false."""
    return sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'processing')"
        " OR EXISTS (SELECT 1 FROM {t} WHERE status = 'pending' AND NOT ordered)"
        " OR EXISTS (SELECT 1 FROM {t} WHERE ordered AND status = 'pending' AND aggregate_seq IS NOT NULL)"
        " OR EXISTS (SELECT 1 FROM {t} WHERE ordered AND status = 'pending' AND aggregate_seq IS NULL)"
    ).format(t=table)
