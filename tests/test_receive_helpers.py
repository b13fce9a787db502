"""From the producer's API to the consumer's helpers, through a relay embedded in the test's
own event loop (relay.Relay) and real brokers: what `received_from_aio_pika`,
`received_from_sqs` and `received_from_sns` (raw delivery and SNS's JSON envelope) read is
what the producer wrote (its event id, aggregate, payload and headers), with each ordered
aggregate's numbers 1, 2, 3 in one epoch, and an inbox applies each event once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Event, Inbox, Outbox, Received, Relay, received_from_aio_pika, received_from_sns, received_from_sqs
from relay.db.names import OutboxNames
from relay.errors import ConfigError
from tests.conftest import Db
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import wait_until_async
from tests.sns_server import REGION, create_topic, unique_topic_name
from tests.sqs_server import ACCOUNT, create_queue, unique_queue_name


def write(names: OutboxNames, producer_dsn: str) -> list[Event]:
    events = [Event("order", f"o-{n % 2}", "OrderChanged", {"n": n}, headers={"tenant": f"t{n}"}) for n in range(6)]
    outbox = Outbox(names.table, names.schema)
    with psycopg.connect(producer_dsn) as conn:
        for event in events:  # one transaction each: commit order is this order
            outbox.add(conn, event)
            conn.commit()
    return events


def check(received: list[Received], events: list[Event]) -> None:
    by_id = {r.event_id: r for r in received}
    assert len(by_id) == len(received) == len(events)
    for event in events:
        got = by_id[event.event_id]
        assert (got.aggregate_id, got.event_type, got.payload(), got.headers) == (
            event.aggregate_id,
            event.event_type,
            event.payload,
            dict(event.headers or {}),
        )
        assert got.replay is None and got.outbox_id is not None
    for aggregate in ("o-0", "o-1"):
        mine = sorted((r for r in received if r.aggregate_id == aggregate), key=lambda r: r.aggregate_seq or 0)
        assert [r.aggregate_seq for r in mine] == [1, 2, 3]
        assert [r.payload()["n"] for r in mine] == sorted(e.payload["n"] for e in events if e.aggregate_id == aggregate)
        assert len({r.aggregate_epoch for r in mine}) == 1 and mine[0].aggregate_epoch is not None


async def run_until_done(db: Db, relay: Relay, total: int) -> None:
    async with relay:
        done = await wait_until_async(lambda: db.statuses() == {"done": total} or relay.failed is not None, timeout=30)
        assert done and relay.failed is None, (db.statuses(), relay.failed)


def applied_once(pg_dsn: str, received: list[Received]) -> list[bool]:
    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        inbox = Inbox("inbox", schema)
        results = []
        with psycopg.connect(pg_dsn) as conn:
            inbox.migrate(conn)
            for r in received + received:  # every message delivered twice
                results.append(inbox.receive(conn, r))
                conn.commit()
        return results
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def test_rabbitmq(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, rabbit: Rabbit, pg_dsn: str
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    events = write(names, producer_dsn)
    relay = Relay(
        dsn=relay_dsn, schema=names.schema, broker="rabbitmq", amqp_url=rabbit.amqp.url, exchange=exchange,
        poll_interval="50ms", workers=2,
    )  # fmt: skip
    await run_until_done(db, relay, len(events))
    messages = await rabbit.drain(queue, len(events), timeout=10)
    received = [received_from_aio_pika(m) for m in messages]
    assert all(m.message_id == str(r.event_id) for m, r in zip(messages, received, strict=True))
    check(received, events)
    ordered = sorted(received, key=lambda r: (r.aggregate_id, r.aggregate_seq or 0))
    assert applied_once(pg_dsn, ordered) == [True] * len(events) + [False] * len(events)


async def test_sqs(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, moto_endpoint: str, make_queue: Any, sqs_client: Any
) -> None:
    url = make_queue(fifo=True)
    events = write(names, producer_dsn)
    relay = Relay(
        dsn=relay_dsn, schema=names.schema, broker="sqs", queue_url=url, endpoint_url=moto_endpoint,
        region=REGION, poll_interval="50ms",
    )  # fmt: skip
    await run_until_done(db, relay, len(events))
    raw = sqs_client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])["Messages"]
    check([received_from_sqs(m) for m in raw], events)


@pytest.mark.parametrize("raw_delivery", [True, False])
async def test_sns(
    db: Db,
    names: OutboxNames,
    producer_dsn: str,
    relay_dsn: str,
    moto_endpoint: str,
    sns_client: Any,
    sqs_client: Any,
    raw_delivery: bool,
) -> None:
    arn = create_topic(sns_client, unique_topic_name(fifo=False))
    queue_name = unique_queue_name(fifo=False)
    url = create_queue(sqs_client, queue_name)
    sns_client.subscribe(
        TopicArn=arn,
        Protocol="sqs",
        Endpoint=f"arn:aws:sqs:{REGION}:{ACCOUNT}:{queue_name}",
        Attributes={"RawMessageDelivery": "true" if raw_delivery else "false"},
    )
    try:
        events = write(names, producer_dsn)
        relay = Relay(
            dsn=relay_dsn, schema=names.schema, broker="sns", topic_arn=arn, endpoint_url=moto_endpoint,
            region=REGION, poll_interval="50ms",
        )  # fmt: skip
        await run_until_done(db, relay, len(events))
        got: list[dict[str, Any]] = []
        for _ in range(20):
            answer = sqs_client.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])
            got += answer.get("Messages", [])
            if len(got) >= len(events):
                break
            await asyncio.sleep(0.1)
        check([received_from_sns(m) for m in got], events)
    finally:
        sqs_client.delete_queue(QueueUrl=url)
        sns_client.delete_topic(TopicArn=arn)


def test_the_embedded_relay_validates_as_relay_start_does(relay_dsn: str) -> None:
    with pytest.raises(ConfigError, match="invalid --workers"):
        Relay(dsn=relay_dsn, broker="log", workers=0)
    with pytest.raises(ConfigError, match="unknown relay setting 'wokers'"):
        Relay(dsn=relay_dsn, broker="log", wokers=2)
    with pytest.raises(ConfigError, match="no SQS queue: pass --queue-url"):
        Relay(dsn=relay_dsn, broker="sqs")  # no queue URL


async def test_the_embedded_relay_raises_what_stopped_it(relay_dsn: str) -> None:
    relay = Relay(dsn=relay_dsn, schema="no_such_schema", broker="log", poll_interval="50ms")
    with pytest.raises(Exception, match="no_such_schema"):
        async with relay:
            await asyncio.sleep(5)
