"""`relay migrate` to 0013 (the history rule, and heads that prune may forget), in place, on
an outbox whose aggregate was numbered by the release before: its counter goes on, its
heads row counts as numbered at the upgrade (so no prune forgets it for the idle time
after it), and the history rule classifies rows as the commands read them."""

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
from relay.retention import prune

LEASE = timedelta(seconds=30)
BEFORE = 11  # the last migration of the release before 0013


@pytest.fixture
def old_names(outbox_at: Callable[[int], OutboxNames]) -> OutboxNames:
    return outbox_at(BEFORE)


async def test_counters_go_on_and_are_not_forgotten_at_once_after_the_upgrade(
    pg_dsn: str, old_names: OutboxNames, owner_pool: AsyncConnectionPool[Any]
) -> None:
    names = old_names
    table = sql.Identifier(names.schema, names.table)
    heads = sql.Identifier(names.schema, f"{names.table}_heads")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [first] = conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', 'a', 'OrderPlaced', '{{}}') RETURNING id"
            ).format(table)
        ).fetchall()
        # As the release before left an aggregate whose three events were delivered and
        # whose first was an operator's skip: numbered 1 to 3, its counter at 3, no head.
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "UPDATE {} SET aggregate_seq = 3, status = 'done', done_at = now(), resolution = 'skipped'"
                    " WHERE id = %s"
                ).format(table),
                first,
            )
            conn.execute(
                sql.SQL("INSERT INTO {} (aggregate_id, head_id, last_seq) VALUES ('a', NULL, 3)").format(heads)
            )
            conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(names.schema, f"{names.table}_commits")))
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', 'a', 'OrderPaid', '{{}}')"
            ).format(table)
        )

    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        assert "0013_history" in (await migrate(conn, names)).applied
        kind = await (
            await conn.execute(
                sql.SQL("SELECT {}(status, resolution) FROM {} WHERE id = %s").format(
                    sql.Identifier(names.schema, f"{names.table}_history"), table
                ),
                first,
            )
        ).fetchone()
        assert kind == ("skipped",)
        # The upgrade counts as the last numbering: an idle-time prune right after it
        # forgets nothing.
        result = await prune(conn, names, timedelta(days=1), heads_idle_for=timedelta(hours=1))
        assert result.heads is not None and result.heads.forgotten == 0

    store = OutboxStore(owner_pool, names)
    [message] = (await store.claim(owner="w", batch=10, lease=LEASE, max_attempts=3)).messages
    assert message.aggregate_seq == 4, "the counter goes on from the release before"
    assert await store.finalize([Decision.published(message)]) == set()
