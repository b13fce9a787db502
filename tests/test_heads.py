"""The per-aggregate heads table: bookkeeping, commit order, and who keeps it in step."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.db.settings import store_ordering
from relay.message import Decision
from relay.ordering import OrderingMap
from tests.conftest import Db

LEASE = timedelta(seconds=30)


def heads(db: Db) -> dict[str, tuple[int | None, bool]]:
    """aggregate -> (head_id, ready)."""
    cur = db.conn.execute(
        sql.SQL("SELECT aggregate_id, head_id, ready_at IS NOT NULL FROM {} ORDER BY 1").format(
            sql.Identifier(db.names.schema, "outbox_heads")
        )
    )
    return {a: (h, r) for a, h, r in cur.fetchall()}


async def claim_ids(store: OutboxStore, owner: str = "w") -> list[int]:
    result = await store.claim(owner=owner, batch=50, lease=LEASE, max_attempts=3)
    return [m.id for m in result.messages]


async def test_head_advances_on_done_stays_on_dead_moves_on_skip(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {}), ("a", "E", {})])
    assert await claim_ids(store) == [ids[0]]
    assert heads(db) == {"a": (ids[0], False)}  # leased: not claimable

    assert await claim_ids(store, "x") == []  # the rows behind it wait

    # done -> the next row becomes the head, ready at once
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'done', lease_until = NULL WHERE id = %s").format(db.table), (ids[0],)
    )
    assert heads(db) == {"a": (ids[1], True)}
    [second] = (await store.claim(owner="w", batch=5, lease=LEASE, max_attempts=3)).messages
    assert second.id == ids[1]

    # dead -> the head stays, and is not claimable
    await store.finalize([Decision.dead(second, "PermanentError: no")])
    assert heads(db) == {"a": (ids[1], False)}
    assert await claim_ids(store) == []

    # skip (an operator marks the dead head finished) -> the head moves on
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'done' WHERE id = %s").format(db.table), (ids[1],))
    assert heads(db) == {"a": (ids[2], True)}
    assert await claim_ids(store) == [ids[2]]


async def test_retry_makes_the_head_ready_at_its_backoff(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "E", {})])
    [m] = (await store.claim(owner="w", batch=5, lease=LEASE, max_attempts=3)).messages
    await store.finalize([Decision.retry(m, 60.0, "RetryableError: later")])
    [(ready_in,)] = db.conn.execute(
        sql.SQL("SELECT extract(epoch FROM ready_at - now()) FROM {}").format(
            sql.Identifier(db.names.schema, "outbox_heads")
        )
    ).fetchall()
    assert 55 < ready_in <= 60
    assert await claim_ids(store) == []
    db.make_available()  # moves available_at; the trigger carries it to the head
    assert await claim_ids(store) == [oid]


async def test_last_row_done_leaves_the_aggregate_idle_and_a_new_row_revives_it(store: OutboxStore, db: Db) -> None:
    [first] = db.insert([("a", "E", {})])
    [m] = (await store.claim(owner="w", batch=5, lease=LEASE, max_attempts=3)).messages
    await store.finalize([Decision.published(m)])
    assert heads(db) == {"a": (None, False)}
    [later] = db.insert([("a", "E", {})])
    assert await claim_ids(store) == [later]
    assert later > first


async def test_deleting_a_head_by_hand_moves_it_on(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {})])
    assert await claim_ids(store) == [ids[0]]
    db.conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(db.table), (ids[0],))
    assert heads(db) == {"a": (ids[1], True)}


async def test_expired_lease_makes_the_head_claimable_again(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {})])
    first = (await store.claim(owner="A", batch=5, lease=LEASE, max_attempts=3)).messages
    db.expire_leases()
    second = (await store.claim(owner="B", batch=5, lease=LEASE, max_attempts=3)).messages
    assert [m.id for m in first] == [m.id for m in second] == [ids[0]]
    assert second[0].lease_version == first[0].lease_version + 1


async def test_unordered_rows_never_get_heads(make_store: Callable[..., Awaitable[OutboxStore]], db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    db.insert([("a", "Email", {}), ("b", "OrderPlaced", {})])
    await claim_ids(store)
    assert set(heads(db)) == {"b"}


async def test_rows_are_routed_when_inserted_by_the_stored_map(
    make_store: Callable[..., Awaitable[OutboxStore]], db: Db
) -> None:
    await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    db.insert([("a", "OrderPlaced", {}), ("a", "Email", {})])
    await make_store(OrderingMap(default_ordered=True))  # the map changes: new rows only
    db.insert([("a", "Email", {})])
    assert [r["ordered"] for r in db.rows()] == [True, False, True]


async def test_storing_a_map_reports_what_it_replaced(make_store: Callable[..., Awaitable[OutboxStore]]) -> None:
    first = await make_store(OrderingMap(default_ordered=False, ordered=("Order*", "Paid.v2")))
    async with first.pool.connection() as conn:
        reordered = OrderingMap(default_ordered=False, ordered=("Paid.v2", "Order*"))
        same = await store_ordering(conn, first.names, reordered)
        assert same.changed == ()  # the same rules in another order: nothing replaced
        change = await store_ordering(conn, first.names, OrderingMap(default_ordered=True))
    assert change.before.ordering == OrderingMap(default_ordered=False, ordered=("Paid.v2", "Order*"))
    assert [(c.setting, c.old, c.new) for c in change.changed] == [
        ("ordering_default", "unordered", "ordered"),
        ("ordered", "['Paid.v2', 'Order*']", "[]"),
    ]


async def test_ingest_numbers_each_row_once(store: OutboxStore, db: Db, pool: Any) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {}), ("b", "E", {})])
    async with pool.connection() as conn:
        for _ in range(3):
            async with conn.transaction():
                await conn.execute(store.query("ingest_lock"))
                await conn.execute(store.query("ingest"), {"transactions": 100})
    assert heads(db) == {"a": (ids[0], True), "b": (ids[2], True)}
    assert [(r["aggregate_id"], r["aggregate_seq"]) for r in db.rows()] == [("a", 1), ("a", 2), ("b", 1)]
    cur = db.conn.execute(
        sql.SQL("SELECT aggregate_id, last_seq FROM {} ORDER BY 1").format(
            sql.Identifier(db.names.schema, "outbox_heads")
        )
    )
    assert cur.fetchall() == [("a", 2), ("b", 1)]


async def test_ingest_skips_while_another_relay_holds_its_turn(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    [oid] = db.insert([("a", "E", {})])
    with psycopg.connect(relay_dsn) as other:
        other.execute(sql.SQL("SELECT 1 FROM {} FOR UPDATE").format(sql.Identifier(db.names.schema, "outbox_ingest")))
        claim = await store.claim(owner="w", batch=5, lease=LEASE, max_attempts=3)
        assert claim.messages == [] and claim.numbered == 0  # no wait: the holder numbers it
    assert await claim_ids(store) == [oid]


async def test_a_row_marked_dead_by_hand_before_it_was_numbered_still_blocks(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {})])
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'dead' WHERE id = %s").format(db.table), (ids[0],))
    assert await claim_ids(store) == []  # numbered first, and dead: the aggregate waits behind it
    assert [r["aggregate_seq"] for r in db.rows()] == [1, 2]
    assert heads(db) == {"a": (ids[0], False)}


def test_the_unfinished_ordered_rows_function_is_inlined_into_its_callers(db: Db) -> None:
    # The heads trigger, relay status and relay explain read an aggregate's unfinished
    # ordered rows through one SQL function (0009); PostgreSQL must inline it, so each
    # caller keeps the index scan the filter written out had, with no call per row.
    db.insert([("a", "OrderPlaced", {})] * 3)
    function = db.names.identifier("q_unfinished_ordered")
    query = sql.SQL("EXPLAIN (FORMAT JSON) SELECT u.id FROM {}(%s) AS u ORDER BY u.aggregate_seq LIMIT 1").format(
        function
    )
    db.conn.execute("SET enable_seqscan = off")  # a tiny table: the plan the real size gets
    try:
        [(plan,)] = db.conn.execute(query, ("a",)).fetchall()
    finally:
        db.conn.execute("RESET enable_seqscan")
    text = json.dumps(plan)
    assert "Function Scan" not in text, text
    assert f"{db.names.table}_aggregate_seq_idx" in text, text
