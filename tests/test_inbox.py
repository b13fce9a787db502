"""relay.Inbox against a real PostgreSQL: duplicates by event id and by number, gaps held
with nothing recorded, epochs (a number used again after a failover or a forgotten
aggregate is new, not a duplicate), concurrent receivers of one aggregate, and the
helpers that read the relay's envelope out of what each broker's client hands over."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Inbox, OutOfOrder, Received, received_from_sns, received_from_sqs


@pytest.fixture
def inbox_dsn(pg_dsn: str) -> Iterator[tuple[str, Inbox]]:
    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    inbox = Inbox("inbox", schema)
    with psycopg.connect(pg_dsn) as conn:
        inbox.migrate(conn)
        inbox.migrate(conn)  # again: nothing changes
        conn.commit()
    yield pg_dsn, inbox
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def event(
    aggregate: str, seq: int | None, epoch: str | None = "1.1.aaaaaaaa", event_id: uuid.UUID | None = None
) -> Received:
    return Received(
        event_id=event_id or uuid.uuid4(),
        aggregate_type="order",
        aggregate_id=aggregate,
        event_type="E",
        body=b"{}",
        aggregate_seq=seq,
        aggregate_epoch=epoch if seq is not None else None,
    )


def receive(dsn: str, inbox: Inbox, received: Received, *, commit: bool = True) -> bool | str:
    with psycopg.connect(dsn) as conn:
        try:
            new = inbox.receive(conn, received)
        except OutOfOrder as exc:
            conn.commit()  # even a careless consumer that commits records nothing
            return f"gap:{exc.expected}"
        if commit:
            conn.commit()
        else:
            conn.rollback()  # (leaving the block would commit)
        return new


def test_unordered_events_are_new_once(inbox_dsn: tuple[str, Inbox]) -> None:
    dsn, inbox = inbox_dsn
    e = event("A", None)
    assert receive(dsn, inbox, e, commit=False) is True  # rolled back: not recorded
    assert receive(dsn, inbox, e) is True
    assert receive(dsn, inbox, e) is False
    assert receive(dsn, inbox, event("A", None)) is True  # another event of the same aggregate


def test_ordered_events_apply_in_order_and_hold_gaps(inbox_dsn: tuple[str, Inbox]) -> None:
    dsn, inbox = inbox_dsn
    first, second, third = event("A", 1), event("A", 2), event("A", 3)
    assert receive(dsn, inbox, second) == "gap:1"
    assert receive(dsn, inbox, first) is True
    assert receive(dsn, inbox, third) == "gap:2"
    assert receive(dsn, inbox, second) is True
    assert receive(dsn, inbox, second) is False
    assert receive(dsn, inbox, third) is True
    # A redelivery of a number already applied is a duplicate even when its event id was pruned.
    with psycopg.connect(dsn) as conn:
        assert inbox.prune(conn, timedelta(0)) == 3
        conn.commit()
    assert receive(dsn, inbox, first) is False


def test_a_number_used_again_in_a_new_epoch_is_new(inbox_dsn: tuple[str, Inbox]) -> None:
    """The failover trap: the old primary numbered 1..5 on timeline 1 and the consumer
    applied them; the promoted standby had only 1..3 and numbers again from 4 on timeline 2
    (epoch '2.4.x'). Those are new events, not duplicates of the lost 4 and 5."""
    dsn, inbox = inbox_dsn
    for seq in range(1, 6):
        assert receive(dsn, inbox, event("A", seq, "1.1.aaaaaaaa")) is True
    assert receive(dsn, inbox, event("A", 5, "2.4.bbbbbbbb")) == "gap:4"
    assert receive(dsn, inbox, event("A", 4, "2.4.bbbbbbbb")) is True
    assert receive(dsn, inbox, event("A", 5, "2.4.bbbbbbbb")) is True
    assert receive(dsn, inbox, event("A", 6, "2.4.bbbbbbbb")) is True
    # An aggregate the relay forgot starts again at 1, in a new epoch.
    assert receive(dsn, inbox, event("A", 1, "2.1.cccccccc")) is True


def test_a_redelivery_from_an_epoch_left_behind_is_a_duplicate(inbox_dsn: tuple[str, Inbox]) -> None:
    """An event applied in one epoch, delivered again after the aggregate moved on to a new
    one (RabbitMQ requeues a message whose ack was lost, after the next ones went through):
    its event id is recorded, so it is a duplicate; it must not wait for a number forever."""
    dsn, inbox = inbox_dsn
    old = [event("A", seq, "1.1.aaaaaaaa") for seq in (1, 2, 3)]
    for e in old:
        assert receive(dsn, inbox, e) is True
    assert receive(dsn, inbox, event("A", 4, "2.4.bbbbbbbb")) is True
    assert receive(dsn, inbox, old[1]) is False
    assert receive(dsn, inbox, old[2]) is False


def test_a_new_epoch_waits_for_the_numbers_before_its_first(inbox_dsn: tuple[str, Inbox]) -> None:
    """The promoted standby had replicated 1..5 and numbers from 6 (epoch '2.6.x'); the
    consumer applied only 1..3. 4 and 5 exist (in epoch 1) and come first; a ghost of the
    old epoch (a number the failover lost, still in the broker) is stale once the new epoch
    is in: a duplicate, never a reason to wait."""
    dsn, inbox = inbox_dsn
    for seq in (1, 2, 3):
        assert receive(dsn, inbox, event("A", seq, "1.1.aaaaaaaa")) is True
    assert receive(dsn, inbox, event("A", 6, "2.6.bbbbbbbb")) == "gap:4"
    assert receive(dsn, inbox, event("A", 7, "2.6.bbbbbbbb")) == "gap:4"
    assert receive(dsn, inbox, event("A", 4, "1.1.aaaaaaaa")) is True
    assert receive(dsn, inbox, event("A", 5, "1.1.aaaaaaaa")) is True
    assert receive(dsn, inbox, event("A", 7, "2.6.bbbbbbbb")) == "gap:6"
    assert receive(dsn, inbox, event("A", 6, "2.6.bbbbbbbb")) is True
    assert receive(dsn, inbox, event("A", 6, "1.1.aaaaaaaa")) is False  # lost on the old primary
    assert receive(dsn, inbox, event("A", 9, "1.1.aaaaaaaa")) is False
    assert receive(dsn, inbox, event("A", 7, "2.6.bbbbbbbb")) is True
    # Numbers applied before the outbox's migration 0015 carry no epoch; the first epoch
    # after it continues them.
    assert receive(dsn, inbox, event("C", 1, None)) is True
    assert receive(dsn, inbox, event("C", 2, None)) is True
    assert receive(dsn, inbox, event("C", 4, "1.3.dddddddd")) == "gap:3"
    assert receive(dsn, inbox, event("C", 3, "1.3.dddddddd")) is True


def test_a_new_aggregate_starts_at_its_epochs_first_number_unless_told(inbox_dsn: tuple[str, Inbox]) -> None:
    dsn, inbox = inbox_dsn
    assert receive(dsn, inbox, event("B", 7, "1.1.aaaaaaaa")) == "gap:1"
    late = Inbox("inbox", _schema_of(inbox), accept_first_unseen=True)
    assert receive(dsn, late, event("B", 7, "1.1.aaaaaaaa")) is True
    assert receive(dsn, late, event("B", 9, "1.1.aaaaaaaa")) == "gap:8"


def _schema_of(inbox: Inbox) -> str:
    return inbox._receive.split('"')[1]


async def test_concurrent_receivers_of_one_aggregate_apply_each_event_once_in_order(
    inbox_dsn: tuple[str, Inbox],
) -> None:
    """Four receivers take deliveries of one aggregate's 40 events, each delivered twice, in
    a shuffled order, and hold (retry later) what comes too early. The effects (a list
    appended in the same transaction) must be 1..40, each once."""
    dsn, inbox = inbox_dsn
    events = [event("A", seq) for seq in range(1, 41)]
    deliveries: asyncio.Queue[Received] = asyncio.Queue()
    import random

    shuffled = events * 2
    random.Random(7).shuffle(shuffled)
    for e in shuffled:
        deliveries.put_nowait(e)
    schema = _schema_of(inbox)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("CREATE TABLE {}.effects (seq bigint, at bigserial)").format(sql.Identifier(schema)))

    async def receiver() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            while True:
                try:
                    e = deliveries.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    async with conn.transaction():
                        if await inbox.receive_async(conn, e):
                            await conn.execute(
                                sql.SQL("INSERT INTO {}.effects (seq) VALUES (%s)").format(sql.Identifier(schema)),
                                (e.aggregate_seq,),
                            )
                except OutOfOrder:
                    deliveries.put_nowait(e)  # requeue
                    await asyncio.sleep(0.001)

    await asyncio.gather(*(receiver() for _ in range(4)))
    with psycopg.connect(dsn) as conn:
        applied = [
            r[0] for r in conn.execute(sql.SQL("SELECT seq FROM {}.effects ORDER BY at").format(sql.Identifier(schema)))
        ]
    assert applied == list(range(1, 41))


def test_autocommit_is_refused(inbox_dsn: tuple[str, Inbox]) -> None:
    from relay import NotInTransaction

    dsn, inbox = inbox_dsn
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(NotInTransaction):
        inbox.receive(conn, event("A", None))


def _attributes(fields: dict[str, Any], *, sns: bool = False) -> dict[str, Any]:
    out = {}
    for name, value in fields.items():
        kind = "Number" if isinstance(value, int) else "String"
        out[name] = {"Type": kind, "Value": str(value)} if sns else {"DataType": kind, "StringValue": str(value)}
    return out


def test_helpers_read_the_envelope_of_sqs_and_sns_messages() -> None:
    event_id = uuid.uuid4()
    fields = {
        "outbox_id": 12,
        "event_id": str(event_id),
        "aggregate_type": "order",
        "aggregate_id": "A",
        "event_type": "OrderPaid",
        "attempt": 1,
        "lease_version": 1,
        "aggregate_seq": 3,
        "aggregate_epoch": "1.1.aaaaaaaa",
        "tenant": "t1",
    }
    sqs = received_from_sqs({"Body": '{"n": 1}', "MessageAttributes": _attributes(fields)})
    assert (sqs.event_id, sqs.aggregate_seq, sqs.aggregate_epoch, sqs.outbox_id, sqs.headers) == (
        event_id,
        3,
        "1.1.aaaaaaaa",
        12,
        {"tenant": "t1"},
    )
    assert sqs.payload() == {"n": 1}
    notification = {
        "Type": "Notification",
        "Message": '{"n": 1}',
        "MessageAttributes": _attributes(fields, sns=True),
    }
    assert received_from_sns({"Body": json.dumps(notification)}) == sqs
    assert received_from_sns({"Body": '{"n": 1}', "MessageAttributes": _attributes(fields)}) == sqs  # raw delivery
    with pytest.raises(ValueError, match="no event_id"):
        received_from_sqs({"Body": "{}", "MessageAttributes": {}})


def test_an_older_epoch_of_the_same_timeline_is_a_duplicate(inbox_dsn: tuple[str, Inbox]) -> None:
    """Issue 38, item 9: epoch A applied 1-3; the relay forgot the aggregate and started
    epoch B at 1; Inbox.prune forgot A's ids; a late redelivery (or a replay) of A's 1 and 2
    is a duplicate, not a rewind, and B goes on. Since the outbox's 0017 the token is a
    counter ('n<k>') that grows in the order epochs are opened."""
    dsn, inbox = inbox_dsn
    a = [event("A", seq, "1.1.n3") for seq in (1, 2, 3)]
    b = [event("A", seq, "1.1.n7") for seq in (1, 2)]
    for e in a:
        assert receive(dsn, inbox, e) is True
    assert receive(dsn, inbox, b[0]) is True
    with psycopg.connect(dsn) as conn:
        assert inbox.prune(conn, timedelta(0)) == 4
        conn.commit()
    assert receive(dsn, inbox, a[0]) is False
    assert receive(dsn, inbox, a[1]) is False
    assert receive(dsn, inbox, b[1]) is True
    assert receive(dsn, inbox, event("A", 4, "1.1.n3")) is False  # a number A never applied: still A's
    # A later timeline is newer whatever its counter (the promoted standby's counter
    # stands where replication left it), and an earlier one older.
    assert receive(dsn, inbox, event("A", 3, "2.3.n5")) is True
    assert receive(dsn, inbox, event("A", 1, "1.1.n9")) is False


def test_epochs_named_before_the_counter_are_older_than_any_counter(inbox_dsn: tuple[str, Inbox]) -> None:
    """Consumers see both formats across the outbox's upgrade: an aggregate that kept its
    heads row goes on in its 8-hex-digit epoch, one opened after the upgrade has a counter.
    On one timeline the old random token is older than any counter; two old tokens are not
    ordered, and the arriving one is taken as newer, as before."""
    dsn, inbox = inbox_dsn
    old = [event("B", seq, "1.1.0123abcd") for seq in (1, 2)]
    for e in old:
        assert receive(dsn, inbox, e) is True
    assert receive(dsn, inbox, event("B", 1, "1.1.n1")) is True  # forgotten, started again after 0017
    with psycopg.connect(dsn) as conn:
        inbox.prune(conn, timedelta(0))
        conn.commit()
    assert receive(dsn, inbox, old[0]) is False
    assert receive(dsn, inbox, event("B", 1, "1.1.99999999")) is False  # all digits, still 8 hex: old
    assert receive(dsn, inbox, event("B", 2, "1.1.n1")) is True
    # Two random tokens: the arriving one is newer (nothing tells them apart in time).
    assert receive(dsn, inbox, event("C", 1, "1.1.aaaaaaaa")) is True
    assert receive(dsn, inbox, event("C", 1, "1.1.bbbbbbbb")) is True
    assert receive(dsn, inbox, event("C", 1, "1.1.n2")) is True
    # A token that is neither (a hand-written one) is not a counter: older than one.
    assert receive(dsn, inbox, event("C", 1, "1.1.n")) is False


def _lock_waiters(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        return bool(row and row[0] == "Lock")


async def test_first_unseen_receivers_of_one_aggregate_cannot_rewind_it(inbox_dsn: tuple[str, Inbox]) -> None:
    """Issue 38, item 10: with accept_first_unseen, two receivers of an aggregate the inbox
    has never seen, in two transactions: 6 is recorded first and its transaction held open,
    then 5 arrives on another connection. 5 must wait for 6 to commit and then see it (a
    duplicate); before the fix both were applied and last_seq ended at 5, so 7 waited
    forever."""
    dsn, _ = inbox_dsn
    late = Inbox("inbox", _schema_of(inbox_dsn[1]), accept_first_unseen=True)
    six, five, seven = (event("U", seq, "1.1.n1") for seq in (6, 5, 7))
    async with (
        await psycopg.AsyncConnection.connect(dsn) as first,
        await psycopg.AsyncConnection.connect(dsn) as second,
    ):

        async def receive_five() -> bool:
            async with second.transaction():
                return await late.receive_async(second, five)

        async with first.transaction():
            assert await late.receive_async(first, six) is True
            racing = asyncio.create_task(receive_five())
            pid = second.info.backend_pid
            for _ in range(500):  # until the second waits on a lock (deterministic from there)
                if _lock_waiters(dsn, pid):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the second receiver never waited for the first")
            assert not racing.done()
        assert await racing is False
    assert receive(dsn, late, seven) is True
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT last_seq FROM {} WHERE aggregate_id = 'U'").format(
                sql.Identifier(_schema_of(late), "inbox_aggregates")
            )
        ).fetchone()
    assert row == (7,)


async def test_one_connection_shared_by_two_tasks_is_refused(inbox_dsn: tuple[str, Inbox]) -> None:
    """Issue 38, item 8: aio-pika runs each delivery as a task, and the documented consumer
    gave them one AsyncConnection. A second task's `conn.transaction()` is then a savepoint
    in the first one's transaction: its receipt commits or rolls back with the other
    message. The inbox refuses it, recording nothing."""
    from relay import ConnectionShared

    dsn, inbox = inbox_dsn
    mine, theirs = event("S", 1, "1.1.n1"), event("T", 1, "1.1.n1")
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        recorded, refused = asyncio.Event(), asyncio.Event()

        async def first() -> None:
            async with conn.transaction():
                assert await inbox.receive_async(conn, mine) is True
                recorded.set()
                await refused.wait()

        async def second() -> None:
            await recorded.wait()
            try:
                async with conn.transaction():
                    await inbox.receive_async(conn, theirs)
            finally:
                refused.set()

        task = asyncio.create_task(first())
        with pytest.raises(ConnectionShared, match="another task"):
            await second()
        await task
    assert receive(dsn, inbox, mine) is False  # the first one's transaction committed
    assert receive(dsn, inbox, theirs) is True  # the refused one recorded nothing


async def test_a_connection_busy_with_another_tasks_statement_is_refused(inbox_dsn: tuple[str, Inbox]) -> None:
    from relay import ConnectionShared

    dsn, inbox = inbox_dsn
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        busy = asyncio.create_task(conn.execute("SELECT pg_sleep(0.5)"))
        await asyncio.sleep(0.1)
        started = asyncio.get_running_loop().time()
        with pytest.raises(ConnectionShared, match="running another statement"):
            await inbox.receive_async(conn, event("S", 1, "1.1.n1"))
        assert asyncio.get_running_loop().time() - started < 0.3  # at once, not after the other
        await busy
        await conn.rollback()


def test_a_transaction_of_another_thread_is_refused(inbox_dsn: tuple[str, Inbox]) -> None:
    import threading

    from relay import ConnectionShared

    dsn, inbox = inbox_dsn
    with psycopg.connect(dsn) as conn:
        recorded, done = threading.Event(), threading.Event()

        def other() -> None:
            with conn.transaction():
                inbox.receive(conn, event("S", None))
                recorded.set()
                done.wait(10)

        thread = threading.Thread(target=other)
        thread.start()
        try:
            assert recorded.wait(10)
            with pytest.raises(ConnectionShared):
                inbox.receive(conn, event("T", None))
        finally:
            done.set()
            thread.join()


async def test_what_one_task_does_with_its_connection_is_not_refused(inbox_dsn: tuple[str, Inbox]) -> None:
    """A batch of receipts in one transaction of one task, a savepoint per message, and a
    pooled connection that tasks take one after another are all right."""
    from psycopg_pool import AsyncConnectionPool

    dsn, inbox = inbox_dsn
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        for seq in (1, 2, 3):
            async with conn.transaction():  # a savepoint
                assert await inbox.receive_async(conn, event("B", seq, "1.1.n1")) is True
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool:

        async def one(e: Received) -> bool:
            async with pool.connection() as conn, conn.transaction():
                return await inbox.receive_async(conn, e)

        results = await asyncio.gather(*(one(event("P", None)) for _ in range(20)))
        assert results == [True] * 20


async def test_sqlalchemy_sessions_receive_too(inbox_dsn: tuple[str, Inbox]) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.orm import Session

    from examples.common import sqlalchemy_url

    dsn, inbox = inbox_dsn
    e = event("Q", 1, "1.1.n1")
    engine = create_engine(sqlalchemy_url(dsn))
    with Session(engine) as session, session.begin():
        assert inbox.receive(session, e) is True
    engine.dispose()
    async_engine = create_async_engine(sqlalchemy_url(dsn))
    async with AsyncSession(async_engine) as session, session.begin():
        assert await inbox.receive_async(session, e) is False
        assert await inbox.receive_async(session, event("Q", 2, "1.1.n1")) is True
    await async_engine.dispose()


def test_migrate_replaces_the_function_of_an_inbox_made_by_an_earlier_release(pg_dsn: str) -> None:
    """An inbox whose tables and receive function an earlier release made (its function
    stood in for here by one that answers 'new' to everything): migrate keeps the rows
    and replaces the function, and the rules of this release apply at once. A consumer
    of the earlier release still running calls the same function with the same
    arguments."""
    schema = f"c_{uuid.uuid4().hex[:12]}"
    ident = sql.Identifier
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(ident(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (event_id uuid PRIMARY KEY, received_at timestamptz NOT NULL DEFAULT now());"
                " CREATE TABLE {} (aggregate_id text PRIMARY KEY, epoch text NOT NULL, last_seq bigint NOT NULL,"
                " updated_at timestamptz NOT NULL DEFAULT now());"
                " INSERT INTO {} VALUES ('A', '1.1.n3', 3);"
                " CREATE FUNCTION {}(p_event_id uuid, p_aggregate_id text, p_seq bigint, p_epoch text,"
                " p_first_unseen boolean) RETURNS TABLE (outcome text, expected bigint) LANGUAGE sql"
                " AS $$ SELECT 'new'::text, NULL::bigint $$"
            ).format(
                ident(schema, "inbox"),
                ident(schema, "inbox_aggregates"),
                ident(schema, "inbox_aggregates"),
                ident(schema, "inbox_receive"),
            )
        )
    try:
        inbox = Inbox("inbox", schema)
        assert receive(pg_dsn, inbox, event("A", 1, "1.1.n2")) is True  # the earlier release's rules
        with psycopg.connect(pg_dsn) as conn:
            inbox.migrate(conn)
            conn.commit()
        assert receive(pg_dsn, inbox, event("A", 1, "1.1.n2")) is False  # an older epoch: this release's
        assert receive(pg_dsn, inbox, event("A", 4, "1.1.n3")) is True
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident(schema)))
