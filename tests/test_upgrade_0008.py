"""`relay migrate` from migration 0007 to 0008 (cheaper inserts), in place: the wake-up
answer carried over from the relays' rows."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import psycopg
import pytest
from psycopg import sql

from relay.db.migrate import migrate
from relay.db.names import OutboxNames


@pytest.fixture
def old_names(outbox_at: Callable[[int], OutboxNames]) -> OutboxNames:
    """An outbox at migration 0007, as the release before 0008 left it."""
    return outbox_at(7)


@pytest.fixture
async def listener(pg_dsn: str, old_names: OutboxNames) -> AsyncIterator[psycopg.AsyncConnection[object]]:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(old_names.qualified)))
        yield conn


def _t(names: OutboxNames, suffix: str = "") -> sql.Identifier:
    return sql.Identifier(names.schema, names.table + suffix)


def _insert(conn: psycopg.Connection[object], names: OutboxNames) -> int:
    row = conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', 'a', 'E', '{{}}')"
            " RETURNING id"
        ).format(_t(names))
    ).fetchone()
    assert row is not None
    return int(row[0])


async def _migrate(pg_dsn: str, names: OutboxNames) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await migrate(conn, names)
    assert result.applied[:1] == ["0008_cheap_inserts"]  # and whatever came after it


@pytest.mark.parametrize(("idle", "notifies"), [(True, 1), (False, 0)])
async def test_the_upgrade_carries_the_relays_state_over_to_the_producers_answer(
    pg_dsn: str, old_names: OutboxNames, listener: psycopg.AsyncConnection[object], idle: bool, notifies: int
) -> None:
    """A relay of this version that is running while the migration runs keeps its row;
    the producers' answer starts from it, not from nothing."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (owner, idle, expires_at) VALUES ('r:1', %s, now() + interval '1 hour')").format(
                _t(old_names, "_listeners")
            ),
            (idle,),
        )
        await _migrate(pg_dsn, old_names)
        _insert(conn, old_names)
    assert len([n async for n in listener.notifies(timeout=1, stop_after=1)]) == notifies
