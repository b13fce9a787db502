"""`relay migrate` from 0010 to 0011 (the commit stamp drawn as the owner), in place: a
producer role granted only what `--grant-producer` grants now cannot commit an ordered
event before the upgrade (its stamp needs INSERT on <table>_commits) and can after it,
with the stamp in place; a producer granted the old list keeps working throughout."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay.db.dispatch import OutboxStore
from relay.db.grants import Grantee, statements
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.message import Decision
from tests.conftest import Roles

LEASE = timedelta(seconds=30)
INSERT = "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', %s, 'E', '{{}}')"


@pytest.fixture
def old_names(outbox_at: Callable[[int], OutboxNames]) -> OutboxNames:
    """An outbox at migration 0010, as the release before 0011 left it."""
    return outbox_at(10)


def _grant_producer(pg_dsn: str, names: OutboxNames, role: str) -> None:
    """This release's producer grants, on an outbox of the release before 0011: all of them
    name objects 0010 already had but the column event_id (migration 0015), left out here."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for statement in statements(names, Grantee("producer", role), "unused"):
            text = statement.as_string(conn)
            assert text.count(", event_id)") <= 1
            conn.execute(text.replace(", event_id)", ")").encode())


async def test_a_producer_with_the_new_grants_commits_ordered_events_once_upgraded(
    pg_dsn: str, old_names: OutboxNames, roles: Roles, owner_pool: AsyncConnectionPool[object]
) -> None:
    names = old_names
    table = sql.Identifier(names.schema, names.table)
    _grant_producer(pg_dsn, names, roles.producer)
    with psycopg.connect(roles.producer_dsn) as producer:
        producer.execute(sql.SQL(INSERT).format(table), ("before",))
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="_commits"):
            producer.commit()  # the deferred stamp ran as the producer
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        assert (await migrate(conn, names)).applied[:1] == ["0011_stamp_as_owner"]  # and whatever came after it
    with psycopg.connect(roles.producer_dsn) as producer:
        producer.execute(sql.SQL(INSERT).format(table), ("after",))
        producer.commit()
    with psycopg.connect(pg_dsn) as owner:
        commits = sql.Identifier(names.schema, f"{names.table}_commits")
        assert owner.execute(sql.SQL("SELECT count(*) FROM {}").format(commits)).fetchone() == (1,)
    store = OutboxStore(owner_pool, names)  # type: ignore[arg-type]
    claim = await store.claim(owner="w", batch=10, lease=LEASE, max_attempts=3)
    assert [m.aggregate_id for m in claim.messages] == ["after"]  # numbered by its stamp, claimed
    assert claim.messages[0].aggregate_seq == 1
    assert await store.finalize([Decision.published(m) for m in claim.messages]) == set()
