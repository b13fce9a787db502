"""A producer role with exactly the privileges `--grant-producer` grants (sql/grants.sql;
the suite's `producer_dsn`) can write the outbox: ordered and unordered events, while a
relay is idle (its insert notifies) and while one works. The routing trigger runs with the
producer's privileges, the commit stamp as the owner (migration 0011)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from relay.ordering import OrderingMap
from relay.shared_settings import store_ordering
from relay.sqlnames import OutboxNames
from tests.helpers import record_listeners


@pytest.mark.parametrize("relay_idle", [True, False])
async def test_a_producer_with_the_granted_privileges_writes_ordered_and_unordered_events(
    pg_dsn: str, names: OutboxNames, producer_dsn: str, relay_idle: bool
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await store_ordering(conn, names, OrderingMap(unordered=("Audit",)))
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(names.qualified)))
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            record_listeners(admin, names, [("r:1", relay_idle, "1 hour")])
        with psycopg.connect(producer_dsn, autocommit=True) as producer, producer.transaction():
            producer.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " VALUES ('order', 'o-1', 'OrderPlaced', '{{}}'), ('order', 'o-1', 'Audit', '{{}}')"
                ).format(sql.Identifier(names.schema, names.table))
            )
        heard = [n async for n in conn.notifies(timeout=1, stop_after=1)]
        assert len(heard) == (1 if relay_idle else 0)
        cur = await conn.execute(
            sql.SQL("SELECT event_type, ordered FROM {} ORDER BY id").format(sql.Identifier(names.schema, names.table))
        )
        assert await cur.fetchall() == [("OrderPlaced", True), ("Audit", False)]
        cur = await conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(names.schema, f"{names.table}_commits"))
        )
        assert await cur.fetchone() == (1,)  # the transaction's commit stamp, written as the producer
