"""`relay migrate` from 0009 to 0010 (producers' headers), in place: rows written before it
have no headers and are delivered as before; rows written after it carry theirs."""

from __future__ import annotations

import json
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
    """An outbox at migration 0009, as the release before 0010 left it."""
    return outbox_at(9)


async def test_rows_before_and_after_the_upgrade(
    pg_dsn: str, old_names: OutboxNames, owner_pool: AsyncConnectionPool[Any]
) -> None:
    table = sql.Identifier(old_names.schema, old_names.table)
    insert = sql.SQL("INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', %s, 'E', '{{}}')")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(insert.format(table), ("before",))
        result = await migrate_now(pg_dsn, old_names)
        assert result[:1] == ["0010_headers"]  # and whatever came after it
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
                " VALUES ('o', 'after', 'E', '{{}}', %s)"
            ).format(table),
            (json.dumps({"tenant": "t-1"}),),
        )
    store = OutboxStore(owner_pool, old_names)
    got = {}
    for _ in range(5):  # as the relay's loop claims: the ingest numbers, the claim leases
        claim = await store.claim(owner="w", batch=10, lease=LEASE, max_attempts=3)
        got.update({m.aggregate_id: m.headers for m in claim.messages})
        assert await store.finalize([Decision.published(m) for m in claim.messages]) == set()
    assert got == {"before": None, "after": {"tenant": "t-1"}}


async def migrate_now(pg_dsn: str, names: OutboxNames) -> list[str]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        return (await migrate(conn, names)).applied
