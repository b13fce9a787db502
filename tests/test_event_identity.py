"""Every event's identity (migration 0015): an event_id that is the producer's (relay.Outbox)
or the database's (raw SQL), the same at every delivery, and an aggregate_epoch that
changes exactly where an aggregate's numbering starts again. Rows written before 0015 get a
derived id, stable across claims. (The promoted-standby case, which needs a real failover,
is tests/test_failover_inbox.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay import Event, Outbox
from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.message import Decision, OutboxMessage
from relay.retention import prune
from tests.conftest import Db

LEASE = timedelta(seconds=30)


async def claim(store: OutboxStore) -> list[OutboxMessage]:
    return list((await store.claim(owner="w", batch=50, lease=LEASE, max_attempts=5)).messages)


async def deliver_all(store: OutboxStore) -> list[OutboxMessage]:
    sent: list[OutboxMessage] = []
    while batch := await claim(store):
        sent += batch
        await store.finalize([Decision.published(m) for m in batch])
    return sent


async def test_event_ids_come_from_the_producer_or_the_database_and_stay(
    store: OutboxStore, db: Db, names: OutboxNames, producer_dsn: str
) -> None:
    [raw] = db.insert([("a", "E", {"raw": True})])
    with psycopg.connect(producer_dsn) as conn:
        api_id = Outbox(names.table, names.schema).add(conn, Event("order", "a", "E", {"api": True}))
    [first] = await claim(store)
    assert first.id == raw
    stored = db.row(raw)["event_id"]
    assert isinstance(stored, uuid.UUID) and first.event_id == str(stored)
    await store.finalize([Decision.retry(first, 0.0, "RetryableError: again")])
    db.make_available()
    [again] = await claim(store)
    assert again.id == raw and again.event_id == first.event_id and again.attempt == 2
    await store.finalize([Decision.published(again)])
    [second] = await claim(store)
    assert second.event_id == str(api_id)
    assert second.envelope()["event_id"] == str(api_id)
    assert second.dedup_id == str(api_id)


async def test_epochs_start_where_numbering_starts_again(
    store: OutboxStore, db: Db, pg_dsn: str, names: OutboxNames
) -> None:
    db.insert([("a", "E", {}), ("a", "E", {}), ("b", "E", {})])
    sent = await deliver_all(store)
    epochs = {(m.aggregate_id, m.aggregate_seq): m.aggregate_epoch for m in sent}
    assert set(epochs) == {("a", 1), ("a", 2), ("b", 1)}
    epoch_a = epochs[("a", 1)]
    assert epoch_a is not None and epoch_a.split(".")[1] == "1"  # '<timeline>.<first seq>.<token>'
    assert epochs[("a", 2)] == epoch_a  # the same epoch while the counter goes on
    assert epochs[("b", 1)] != epoch_a
    assert all(m.aggregate_epoch is None for m in sent if not m.ordered)

    db.insert([("a", "E", {})])
    [third] = await deliver_all(store)
    assert (third.aggregate_seq, third.aggregate_epoch) == (3, epoch_a)

    # relay prune forgets a's counter (nothing unfinished, idle): a comes back at 1, in a new epoch.
    db.conn.execute(
        sql.SQL("UPDATE {} SET numbered_at = now() - interval '2 hours'").format(
            sql.Identifier(names.schema, f"{names.table}_heads")
        )
    )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await prune(conn, names, timedelta(days=1), heads_idle_for=timedelta(hours=1))
    assert result.heads is not None and result.heads.forgotten == 2
    db.insert([("a", "E", {})])
    [back] = await deliver_all(store)
    assert back.aggregate_seq == 1
    assert back.aggregate_epoch is not None and back.aggregate_epoch != epoch_a
    assert back.aggregate_epoch.split(".")[1] == "1"


async def test_rows_written_before_0015_get_a_derived_id_that_does_not_change(
    pg_dsn: str, outbox_at: Callable[[int], OutboxNames], owner_pool: AsyncConnectionPool[Any]
) -> None:
    names = outbox_at(13)
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', 'a', 'E', '{{}}'), ('order', 'b', 'E', '{{}}')"
            ).format(table)
        )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, names)
    store = OutboxStore(owner_pool, names)
    first = await claim(store)
    assert len(first) == 2 and all(m.event_id for m in first)
    assert first[0].event_id != first[1].event_id
    await store.finalize([Decision.retry(m, 0.0, "RetryableError: again") for m in first])
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("UPDATE {} SET available_at = now()").format(table))
        conn.execute("SET TimeZone = 'Asia/Kolkata'")  # the derivation reads no session setting
        derived = dict(
            conn.execute(
                sql.SQL("SELECT id, {}(event_id, id, xid, created_at)::text FROM {}").format(
                    sql.Identifier(names.schema, f"{names.table}_event_id"), table
                )
            ).fetchall()
        )
    again = await claim(store)
    assert {m.id: m.event_id for m in again} == {m.id: m.event_id for m in first} == derived
