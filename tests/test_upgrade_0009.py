"""`relay migrate` from 0008 through 0009 (one definition of an aggregate's unfinished
ordered rows), in place, with an aggregate numbered and its head offered before the
upgrade: its head moves on as before."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.message import Decision

LEASE = timedelta(seconds=30)


@pytest.fixture
def old_names(outbox_at: Callable[[int], OutboxNames]) -> OutboxNames:
    """An outbox at migration 0008, as the release before 0009 left it."""
    return outbox_at(8)


async def test_heads_move_on_in_order_across_the_upgrade(
    pg_dsn: str, old_names: OutboxNames, owner_pool: AsyncConnectionPool[Any]
) -> None:
    names = old_names
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        ids = [
            row[0]
            for row in conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', 'a', 'OrderPlaced', '{{}}' FROM generate_series(1, 3) RETURNING id"
                ).format(table)
            ).fetchall()
        ]
    store = OutboxStore(owner_pool, names)
    # Numbered, and the first row offered as head, before the upgrade, as the ingest of
    # that release left them (today's ingest writes 0013's column, which 0008 lacks): the
    # numbers, the heads row with its counter, the commit stamp consumed.
    with psycopg.connect(pg_dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(
            sql.SQL(
                "UPDATE {} AS o SET aggregate_seq = n.seq FROM unnest(%s::bigint[], %s::bigint[]) AS n(id, seq)"
                " WHERE o.id = n.id"
            ).format(table),
            (ids, [1, 2, 3]),
        )
        conn.execute(
            sql.SQL("INSERT INTO {} (aggregate_id, head_id, ready_at, last_seq) VALUES ('a', %s, now(), 3)").format(
                sql.Identifier(names.schema, f"{names.table}_heads")
            ),
            (ids[0],),
        )
        conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(names.schema, f"{names.table}_commits")))

    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await migrate(conn, names)
    assert result.applied[:1] == ["0009_unfinished_ordered"]  # and whatever came after it

    # The head offered under 0008 is claimed and finishes under 0009: the heads trigger, now
    # reading the function, hands the aggregate to the next number, and so on to the end.
    delivered = []
    leased = (await store.claim(owner="new", batch=10, lease=LEASE, max_attempts=3)).messages
    while leased:
        assert len(leased) == 1, "only the head of an aggregate may be in flight"
        delivered.append(leased[0].id)
        assert await store.finalize([Decision.published(leased[0])]) == set()
        leased = (await store.claim(owner="new", batch=10, lease=LEASE, max_attempts=3)).messages
    assert delivered == ids
