"""Epochs ordered on one timeline, through the real relay (issue 38, item 9): an aggregate
the relay forgot (`relay prune --heads-idle-for`) starts again at 1 in a new epoch, and
once the consumer's inbox has forgotten the old epoch's event ids (`Inbox.prune`), a late
redelivery or a replay of the old epoch's numbers must be a duplicate, not a rewind that
leaves the new epoch waiting forever.

And the upgrade to the outbox's migration 0017 in place: an aggregate that keeps its heads
row goes on in its old epoch (8 random hex digits), one opened after it has a counter.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay import Event, Inbox, Outbox, Received, Relay, received_from_aio_pika
from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.message import Decision
from tests.conftest import Db
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import relay_env, run_relay, wait_until_async

LEASE = timedelta(seconds=30)


@pytest.fixture
def inbox(pg_dsn: str) -> Iterator[Inbox]:
    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    inbox = Inbox("inbox", schema)
    with psycopg.connect(pg_dsn) as conn:
        inbox.migrate(conn)
    yield inbox
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def write(producer_dsn: str, names: OutboxNames, aggregate: str, names_of_events: list[str]) -> None:
    outbox = Outbox(names.table, names.schema)
    with psycopg.connect(producer_dsn) as conn:
        for name in names_of_events:  # one transaction each: commit order is this order
            outbox.add(conn, Event("order", aggregate, "OrderChanged", {"name": name}))
            conn.commit()


async def deliver(db: Db, relay_dsn: str, names: OutboxNames, rabbit: Rabbit, exchange: str) -> None:
    """A relay in this process until nothing of the outbox is left to deliver."""
    async with Relay(
        dsn=relay_dsn, schema=names.schema, broker="rabbitmq", amqp_url=rabbit.amqp.url, exchange=exchange,
        poll_interval="50ms",
    ) as relay:  # fmt: skip
        settled = await wait_until_async(lambda: set(db.statuses()) <= {"done"} or relay.failed is not None, timeout=30)
        assert settled and relay.failed is None, (db.statuses(), relay.failed)


def apply(pg_dsn: str, inbox: Inbox, received: Received) -> bool:
    with psycopg.connect(pg_dsn) as conn:
        new = inbox.receive(conn, received)
        conn.commit()
        return new


async def test_an_old_epoch_redelivered_after_both_sides_forgot_is_a_duplicate(
    db: Db, names: OutboxNames, pg_dsn: str, producer_dsn: str, relay_dsn: str, rabbit: Rabbit, inbox: Inbox
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))

    # Epoch A: 1-3, delivered and applied.
    write(producer_dsn, names, "order-1", ["A1", "A2", "A3"])
    await deliver(db, relay_dsn, names, rabbit, exchange)
    a = [received_from_aio_pika(m) for m in await rabbit.drain(queue, 3, timeout=10)]
    assert [r.aggregate_seq for r in a] == [1, 2, 3]
    assert [apply(pg_dsn, inbox, r) for r in a] == [True, True, True]

    # The relay forgets the idle aggregate (idle for 2 h, as far as its heads row says).
    db.conn.execute(
        sql.SQL("UPDATE {} SET numbered_at = now() - interval '2 hours'").format(
            sql.Identifier(names.schema, f"{names.table}_heads")
        )
    )
    pruned = run_relay(
        "prune", "--dsn", relay_dsn, "--schema", names.schema, "--older-than", "0", "--heads-idle-for", "1h",
        "--json", env=relay_env(),
    )  # fmt: skip
    assert pruned.returncode == 0, pruned.stderr
    with db.conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(names.schema, f"{names.table}_heads")))
        assert cur.fetchone() == (0,)

    # Epoch B starts again at 1; its 1 is applied.
    write(producer_dsn, names, "order-1", ["B1", "B2"])
    await deliver(db, relay_dsn, names, rabbit, exchange)
    b = [received_from_aio_pika(m) for m in await rabbit.drain(queue, 2, timeout=10)]
    assert [r.aggregate_seq for r in b] == [1, 2]
    epoch_a, epoch_b = a[0].aggregate_epoch or "", b[0].aggregate_epoch or ""
    assert epoch_a != epoch_b and epoch_a.split(".")[:2] == epoch_b.split(".")[:2]  # one timeline, both from 1
    assert apply(pg_dsn, inbox, b[0]) is True

    # The inbox forgets the ids; A's 1 and 2 come again (a late redelivery, a replay).
    with psycopg.connect(pg_dsn) as conn:
        assert inbox.prune(conn, timedelta(0)) == 4
        conn.commit()
    assert apply(pg_dsn, inbox, a[0]) is False
    assert apply(pg_dsn, inbox, a[1]) is False
    assert apply(pg_dsn, inbox, b[1]) is True  # B goes on: no OutOfOrder
    # What tells them apart: B's counter is larger ('<timeline>.<first seq>.n<counter>').
    assert int(epoch_b.split(".")[2].removeprefix("n")) > int(epoch_a.split(".")[2].removeprefix("n"))


async def test_upgrading_to_0017_keeps_open_epochs_and_counts_new_ones(
    pg_dsn: str, outbox_at: Callable[[int], OutboxNames], owner_pool: AsyncConnectionPool[Any]
) -> None:
    names = outbox_at(16)
    table = sql.Identifier(names.schema, names.table)
    heads = sql.Identifier(names.schema, f"{names.table}_heads")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [timeline] = conn.execute(
            "SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int::text"
        ).fetchall()[0]
        old_epoch = f"{timeline}.1.0123abcd"
        # As the release before left aggregate 'a': 1 and 2 numbered and delivered in an
        # epoch with a random token, its heads row kept.
        conn.execute(
            sql.SQL("INSERT INTO {} (aggregate_id, head_id, last_seq, epoch) VALUES ('a', NULL, 2, %s)").format(heads),
            (old_epoch,),
        )
        for aggregate in ("a", "b", "c"):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " VALUES ('order', %s, 'E', '{{}}')"
                ).format(table),
                (aggregate,),
            )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        assert "0017_epoch_counter" in (await migrate(conn, names)).applied

    store = OutboxStore(owner_pool, names)
    claimed = (await store.claim(owner="w", batch=10, lease=LEASE, max_attempts=3)).messages
    epochs = {m.aggregate_id: (m.aggregate_seq, m.aggregate_epoch) for m in claimed}
    assert epochs["a"] == (3, old_epoch), "an open epoch goes on, in its old name"
    assert {epochs["b"], epochs["c"]} == {(1, f"{timeline}.1.n1"), (1, f"{timeline}.1.n2")}
    assert await store.finalize([Decision.published(m) for m in claimed]) == set()
