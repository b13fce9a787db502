"""The failover trap, with real clusters: a primary and an asynchronous standby. Events the
old primary committed and the relay delivered are lost by the failover; the promoted
standby numbers the aggregate's new events again from what it had (the same
aggregate_seq numbers, in a new epoch). A consumer that keeps the last number per
aggregate would drop them as duplicates; the inbox applies every one, once."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from relay import Event, Inbox, Outbox, OutOfOrder, Received, Relay, received_from_aio_pika
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from tests.pg_clusters import ClusterPair, _run
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import wait_until_async

# Real clusters, stopped and promoted: alone, after the rest, in make test-all and test-faults.
pytestmark = [pytest.mark.faults, pytest.mark.extended]

NAMES = OutboxNames(schema="public", table="outbox")


@pytest.fixture
def consumer_schema(pg_dsn: str) -> Iterator[str]:
    name = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def write(dsn: str, events: list[Event]) -> None:
    with psycopg.connect(dsn) as conn:
        for event in events:
            Outbox().add(conn, event)
            conn.commit()  # one transaction each: their order is commit order


async def deliver(dsn: str, rabbit: Rabbit, exchange: str, total: int) -> None:
    """A relay embedded here until ``total`` rows of the outbox at ``dsn`` are done."""

    def done() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT count(*) FROM public.outbox WHERE status = 'done'").fetchone()
            return bool(row and row[0] >= total)

    async with Relay(dsn=dsn, broker="rabbitmq", amqp_url=rabbit.amqp.url, exchange=exchange,
                     poll_interval="50ms") as relay:  # fmt: skip
        assert await wait_until_async(lambda: done() or relay.failed is not None, timeout=30), relay.failed
        assert relay.failed is None


def apply(pg_dsn: str, schema: str, got: list[Received]) -> tuple[list[str], list[str]]:
    """The consumer: each delivery through the inbox, in arrival order; (applied, dropped)."""
    inbox = Inbox("inbox", schema)
    applied: list[str] = []
    dropped: list[str] = []
    with psycopg.connect(pg_dsn) as conn:
        for r in got:
            try:
                (applied if inbox.receive(conn, r) else dropped).append(r.payload()["name"])
            except OutOfOrder as exc:  # pragma: no cover - the assertion below shows it
                raise AssertionError(str(exc)) from exc
            conn.commit()
    return applied, dropped


async def test_the_inbox_applies_new_events_a_promoted_standby_numbers_again(
    pg_pair: ClusterPair, rabbit: Rabbit, pg_dsn: str, consumer_schema: str
) -> None:
    primary, standby = pg_pair.primary, pg_pair.standby
    with psycopg.connect(primary.dsn("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = ''")  # asynchronous from here
        conn.execute("SELECT pg_reload_conf()")
    async with await psycopg.AsyncConnection.connect(primary.dsn(), autocommit=True) as conn:
        await migrate(conn, NAMES)
    with psycopg.connect(pg_dsn) as conn:
        Inbox("inbox", consumer_schema).migrate(conn)
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))

    # Old primary: E1-E3 delivered and replicated.
    write(primary.dsn(), [Event("order", "A", "Changed", {"name": f"E{n}"}) for n in (1, 2, 3)])
    await deliver(primary.dsn(), rabbit, exchange, 3)

    def replicated() -> bool:
        with psycopg.connect(primary.dsn(), autocommit=True) as p, psycopg.connect(standby.dsn(), autocommit=True) as s:
            row = p.execute("SELECT pg_current_wal_lsn()").fetchone()
            lag = s.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0] if row else "0/0",)).fetchone()
            return bool(lag and lag[0])

    assert await wait_until_async(replicated, timeout=30)
    # The standby falls behind (stopped), and E4, E5 are committed and delivered: lost below.
    _run("pg_ctlcluster", "15", standby.name, "stop")
    write(primary.dsn(), [Event("order", "A", "Changed", {"name": f"E{n}"}) for n in (4, 5)])
    await deliver(primary.dsn(), rabbit, exchange, 5)
    first = [received_from_aio_pika(m) for m in await rabbit.drain(queue, 5, timeout=10)]
    applied, dropped = apply(pg_dsn, consumer_schema, first)
    assert (applied, dropped) == (["E1", "E2", "E3", "E4", "E5"], [])

    # Failover: the primary crashes, the standby (without E4, E5) is promoted.
    primary.stop_immediately()
    standby.start()
    standby.promote()

    def writable() -> bool:
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            row = conn.execute("SELECT NOT pg_is_in_recovery()").fetchone()
            return bool(row and row[0])

    assert await wait_until_async(writable, timeout=30)
    write(standby.dsn(), [Event("order", "A", "Changed", {"name": f"N{n}"}) for n in (4, 5, 6)])
    await deliver(standby.dsn(), rabbit, exchange, 6)
    second = [received_from_aio_pika(m) for m in await rabbit.drain(queue, 3, timeout=10)]

    # The trap is real: the new events carry the numbers the lost ones had.
    lost = {r.aggregate_seq: r for r in first if r.payload()["name"] in ("E4", "E5")}
    reused = [r for r in second if r.aggregate_seq in lost]
    assert [r.payload()["name"] for r in reused] == ["N4", "N5"]
    assert all(r.aggregate_epoch != lost[r.aggregate_seq].aggregate_epoch for r in reused)
    assert all(r.event_id != lost[r.aggregate_seq].event_id for r in reused)
    # And the inbox applies every new event, once, in order.
    applied, dropped = apply(pg_dsn, consumer_schema, second + second)
    assert applied == ["N4", "N5", "N6"] and dropped == ["N4", "N5", "N6"]
    assert [r.aggregate_seq for r in second] == [4, 5, 6]
    assert {(r.aggregate_epoch or "").split(".")[0] for r in second} == {"2"}  # timeline 2
