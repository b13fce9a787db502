"""relay.Consumer's runner for each destination, run as docs/python-api.md shows it (each
marked block executed as written, its names given here) against the real broker, fed by
the real relay: every event applied once and each aggregate's in order, with every
message delivered again (a duplicate) and, where the destination lets a test do it, in
another order (held, then offered again).

The HTTP receiver verifies Standard Webhooks signatures made by the relay and by the
`standardwebhooks` package, and refuses what does not verify.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import CodeType
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from relay import (
    Consumer,
    Event,
    Inbox,
    Outbox,
    Received,
    Relay,
    Verdict,
    WebhookRejected,
    received_from_webhook,
)
from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.pg_clusters import free_port
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import wait_until_async
from tests.sns_server import REGION, create_topic, unique_topic_name
from tests.sqs_server import ACCOUNT, create_queue, receive_all, unique_queue_name

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "python-api.md"
BLOCK = re.compile(r"<!-- consumer-(?P<name>[a-z]+) -->\n```python\n(?P<body>.*?)\n```", re.S)
# `await` at a block's top level, as the docs write it (the block is a coroutine's body).
ALLOW_TOP_LEVEL_AWAIT = 0x2000
AGGREGATES, PER_AGGREGATE = 4, 5
SECRET = "whsec_" + base64.b64encode(b"consumer-test-key-0123456789abcd").decode()


def doc_block(name: str) -> CodeType:
    blocks = {m["name"]: m["body"] for m in BLOCK.finditer(DOC.read_text())}
    return compile(blocks[name], f"{DOC.name}:consumer-{name}", "exec", flags=ALLOW_TOP_LEVEL_AWAIT)


async def run_doc_block(name: str, namespace: dict[str, Any]) -> None:
    result = eval(doc_block(name), namespace)  # a coroutine when the block awaits
    if asyncio.iscoroutine(result):
        await result


def test_every_consumer_block_of_the_docs_is_run_here() -> None:
    names = {m["name"] for m in BLOCK.finditer(DOC.read_text())}
    assert names == {"inbox", "sqs", "sns", "kafka", "nats", "webhook"}


@pytest.fixture
async def consumer_db(scratch_dsn: str) -> AsyncIterator[tuple[str, AsyncConnectionPool[Any]]]:
    """A consumer's database of its own: the inbox (public.inbox) and ``effects``, written
    in the receipt's transaction, without a unique key (an effect applied twice shows)."""
    with psycopg.connect(scratch_dsn) as conn:
        Inbox().migrate(conn)
        conn.execute(
            "CREATE TABLE effects (applied bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid NOT NULL,"
            " aggregate_id text NOT NULL, k integer NOT NULL)"
        )
    async with AsyncConnectionPool(scratch_dsn, min_size=1, max_size=8, open=False) as pool:
        yield scratch_dsn, pool


async def record(conn: psycopg.AsyncConnection[Any], event: Received) -> None:
    await conn.execute(
        "INSERT INTO effects (event_id, aggregate_id, k) VALUES (%s, %s, %s)",
        (event.event_id, event.aggregate_id, event.payload()["k"]),
    )


def consumer_of(pool: AsyncConnectionPool[Any], retry_delay: float = 0.1) -> Consumer:
    return Consumer(pool, Inbox(), record, retry_delay=retry_delay)


def write(names: OutboxNames, producer_dsn: str) -> list[Event]:
    """AGGREGATES aggregates' PER_AGGREGATE ordered events each, interleaved, one
    transaction each (commit order is this order)."""
    events = [
        Event("order", f"agg-{a}", "OrderChanged", {"aggregate": f"agg-{a}", "k": k})
        for k in range(1, PER_AGGREGATE + 1)
        for a in range(AGGREGATES)
    ]
    outbox = Outbox(names.table, names.schema)
    with psycopg.connect(producer_dsn) as conn:
        for event in events:
            outbox.add(conn, event)
            conn.commit()
    return events


async def deliver(db: Db, relay: Relay, total: int) -> None:
    async with relay:
        done = await wait_until_async(lambda: db.statuses() == {"done": total} or relay.failed is not None, timeout=30)
        assert done and relay.failed is None, (db.statuses(), relay.failed)


def effects(dsn: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT event_id::text, aggregate_id, k FROM effects ORDER BY applied").fetchall()


def check(dsn: str, events: list[Event]) -> None:
    """Each event applied once, each aggregate's in order."""
    applied = effects(dsn)
    assert sorted(e for e, _a, _k in applied) == sorted(str(e.event_id) for e in events)
    for a in range(AGGREGATES):
        assert [k for _e, agg, k in applied if agg == f"agg-{a}"] == list(range(1, PER_AGGREGATE + 1))


async def until_applied(dsn: str, events: list[Event], running: asyncio.Task[Any], timeout: float = 30) -> None:
    """Until every event's effect is in (the runner still running), then a moment for a
    late duplicate to show; the runner cancelled."""
    try:
        done = await wait_until_async(lambda: len(effects(dsn)) >= len(events) or running.done(), timeout, 0.05)
        if running.done():
            running.result()  # its exception, if it raised
        assert done, f"{len(effects(dsn))} of {len(events)} applied"
        await asyncio.sleep(0.5)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
    check(dsn, events)


def shuffled_twice(items: list[Any], seed: int) -> list[Any]:
    twice = items + items
    random.Random(seed).shuffle(twice)
    return twice


# --- RabbitMQ: the inbox by hand (the block before Consumer's) ---------------------------


async def test_the_inbox_block_on_rabbitmq(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, rabbit: Rabbit,
    consumer_db: tuple[str, AsyncConnectionPool[Any]],
) -> None:  # fmt: skip
    dsn, pool = consumer_db
    exchange = await rabbit.exchange("topic")
    source = await rabbit.queue(bind=(exchange, "#"))
    events = write(names, producer_dsn)
    relay = Relay(dsn=relay_dsn, schema=names.schema, broker="rabbitmq", amqp_url=rabbit.amqp.url,
                  exchange=exchange, poll_interval="50ms")  # fmt: skip
    await deliver(db, relay, len(events))
    delivered = await rabbit.drain(source, len(events))
    target = await rabbit.queue()

    async def apply(conn: psycopg.AsyncConnection[Any], payload: dict[str, Any]) -> None:
        event_id = next(str(e.event_id) for e in events if e.payload == payload)
        await conn.execute(
            "INSERT INTO effects (event_id, aggregate_id, k) VALUES (%s, %s, %s)",
            (event_id, payload["aggregate"], payload["k"]),
        )

    namespace: dict[str, Any] = {"psycopg": psycopg, "asyncio": asyncio, "CONSUMER_DSN": dsn, "pool": pool,
                                 "apply": apply}  # fmt: skip
    await run_doc_block("inbox", namespace)
    connection = await aio_pika.connect(rabbit.amqp.url)
    async with connection:
        channel = await connection.channel()
        for m in shuffled_twice(delivered, seed=1):  # every message twice, in another order
            await channel.default_exchange.publish(
                aio_pika.Message(m.body, headers=m.headers, message_id=m.message_id), routing_key=target
            )
        await channel.set_qos(prefetch_count=50)
        queue = await channel.get_queue(target)
        tag = await queue.consume(namespace["on_message"])
        await until_applied(dsn, events, asyncio.create_task(asyncio.Event().wait()))
        await queue.cancel(tag)


# --- SQS and SNS ---------------------------------------------------------------------------


async def test_the_sqs_block(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, moto_endpoint: str, sqs_client: Any,
    make_queue: Callable[..., str], consumer_db: tuple[str, AsyncConnectionPool[Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import boto3

    dsn, pool = consumer_db
    url = make_queue(fifo=False)
    events = write(names, producer_dsn)
    relay = Relay(dsn=relay_dsn, schema=names.schema, broker="sqs", queue_url=url, endpoint_url=moto_endpoint,
                  region=REGION, poll_interval="50ms")  # fmt: skip
    await deliver(db, relay, len(events))
    for m in shuffled_twice(receive_all(sqs_client, url), seed=2):
        attributes = {k: {"DataType": m.data_types[k], "StringValue": v} for k, v in m.attributes.items()}
        sqs_client.send_message(QueueUrl=url, MessageBody=m.body, MessageAttributes=attributes)
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", moto_endpoint)
    namespace = {"boto3": boto3, "consumer": consumer_of(pool), "QUEUE_URL": url}
    await until_applied(dsn, events, asyncio.create_task(run_doc_block("sqs", namespace)))


async def test_the_sns_block(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, moto_endpoint: str, sqs_client: Any,
    sns_client: Any, consumer_db: tuple[str, AsyncConnectionPool[Any]], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    import boto3

    dsn, pool = consumer_db
    arn = create_topic(sns_client, unique_topic_name(fifo=False))
    queue_name = unique_queue_name(fifo=False)
    url = create_queue(sqs_client, queue_name)
    # Not raw: the queue gets SNS's JSON envelope, the relay's fields inside it.
    sns_client.subscribe(TopicArn=arn, Protocol="sqs", Endpoint=f"arn:aws:sqs:{REGION}:{ACCOUNT}:{queue_name}")
    try:
        events = write(names, producer_dsn)
        relay = Relay(dsn=relay_dsn, schema=names.schema, broker="sns", topic_arn=arn, endpoint_url=moto_endpoint,
                      region=REGION, poll_interval="50ms")  # fmt: skip
        await deliver(db, relay, len(events))
        await wait_until_async(lambda: True, 0.2)
        for m in shuffled_twice(receive_all(sqs_client, url, idle_s=0.5), seed=3):
            sqs_client.send_message(QueueUrl=url, MessageBody=m.body)
        monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", moto_endpoint)
        namespace = {"boto3": boto3, "consumer": consumer_of(pool), "SUBSCRIBED_QUEUE_URL": url}
        await until_applied(dsn, events, asyncio.create_task(run_doc_block("sns", namespace)))
    finally:
        sqs_client.delete_queue(QueueUrl=url)


# --- Kafka ---------------------------------------------------------------------------------


async def test_the_kafka_block(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, kafka: Any,
    consumer_db: tuple[str, AsyncConnectionPool[Any]],
) -> None:  # fmt: skip
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    dsn, pool = consumer_db
    topic = await asyncio.to_thread(kafka.create_topic, 3)  # (its helpers run loops of their own)
    events = write(names, producer_dsn)
    relay = Relay(dsn=relay_dsn, schema=names.schema, broker="kafka", bootstrap_servers=kafka.bootstrap,
                  topic=topic, poll_interval="50ms")  # fmt: skip
    await deliver(db, relay, len(events))
    # Every record again, after the originals (Kafka keeps a partition's order: a record
    # cannot come before an earlier one of its key, only again).
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()
    try:
        for r in await asyncio.to_thread(kafka.read, topic):
            headers = [(k, v.encode()) for k, v in r.headers.items()]
            await producer.send_and_wait(topic, r.value, key=r.key, partition=r.partition, headers=headers)
    finally:
        await producer.stop()
    namespace = {"AIOKafkaConsumer": AIOKafkaConsumer, "consumer": consumer_of(pool), "TOPIC": topic,
                 "BOOTSTRAP": kafka.bootstrap}  # fmt: skip
    # Stopped part-way (what it applied but had not committed is read again), then again.
    first = asyncio.create_task(run_doc_block("kafka", namespace))
    await wait_until_async(lambda: len(effects(dsn)) >= len(events) // 2 or first.done(), 30, 0.01)
    first.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await first
    await until_applied(dsn, events, asyncio.create_task(run_doc_block("kafka", namespace)))


# --- NATS JetStream --------------------------------------------------------------------------


async def test_the_nats_block(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, nats_stream: Any,
    consumer_db: tuple[str, AsyncConnectionPool[Any]],
) -> None:  # fmt: skip
    import nats

    dsn, pool = consumer_db
    await asyncio.to_thread(nats_stream.create)  # (its helpers run loops of their own)
    subject = nats_stream.subject("orders")
    events = write(names, producer_dsn)
    relay = Relay(dsn=relay_dsn, schema=names.schema, broker="nats", nats_url=nats_stream.url, subject=subject,
                  poll_interval="50ms")  # fmt: skip
    await deliver(db, relay, len(events))
    nc = await nats.connect(nats_stream.url)
    try:
        js = nc.jetstream()
        for m in shuffled_twice(await asyncio.to_thread(nats_stream.read), seed=4):
            # Without Nats-Msg-Id, or the stream's duplicate window would drop them.
            headers = {k: v for k, v in m.headers.items() if k != "Nats-Msg-Id"}
            await js.publish(m.subject, m.data, headers=headers)
    finally:
        await nc.close()
    namespace = {"nats": nats, "consumer": consumer_of(pool), "NATS_URL": nats_stream.url, "SUBJECT": subject}
    await until_applied(dsn, events, asyncio.create_task(run_doc_block("nats", namespace)))


# --- HTTP ------------------------------------------------------------------------------------


def webhook_request(
    event_id: str, fields: dict[str, str], body: bytes, *, secret: str = SECRET, when: datetime | None = None
) -> dict[str, str]:
    """Headers as the relay sends them, signed by the `standardwebhooks` package."""
    from standardwebhooks import Webhook

    when = when or datetime.now(UTC)
    signature = Webhook(secret).sign(event_id, when, body.decode())
    relay_headers = {"Relay-" + "-".join(w.capitalize() for w in k.split("_")): v for k, v in fields.items()}
    return {
        "Content-Type": "application/json", "Idempotency-Key": event_id, **relay_headers,
        "webhook-id": event_id, "webhook-timestamp": str(int(when.timestamp())), "webhook-signature": signature,
    }  # fmt: skip


@pytest.fixture
async def receiver(
    consumer_db: tuple[str, AsyncConnectionPool[Any]], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[str]:
    """The docs' aiohttp application on a loopback port; its URL."""
    from aiohttp import web

    _dsn, pool = consumer_db
    monkeypatch.setenv("WEBHOOK_SECRET", SECRET)
    namespace: dict[str, Any] = {"web": web, "os": __import__("os"), "consumer": consumer_of(pool, retry_delay=1)}
    await run_doc_block("webhook", namespace)
    runner = web.AppRunner(namespace["app"])
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/events"
    finally:
        await runner.cleanup()


async def test_the_webhook_block(
    db: Db, names: OutboxNames, producer_dsn: str, relay_dsn: str, receiver: str,
    consumer_db: tuple[str, AsyncConnectionPool[Any]], tmp_path: Path,
) -> None:  # fmt: skip
    import aiohttp

    dsn, _pool = consumer_db
    early_id = str(uuid.uuid4())
    early = {"aggregate_id": "agg-0", "aggregate_type": "order", "event_type": "OrderChanged",
             "aggregate_seq": "2", "aggregate_epoch": "1.1.n999"}  # fmt: skip
    body = b'{"aggregate": "agg-0", "k": 99}'
    async with aiohttp.ClientSession() as http:

        async def post(headers: dict[str, str], data: bytes = body) -> tuple[int, str, str | None]:
            async with http.post(receiver, data=data, headers=headers) as answer:
                return answer.status, await answer.text(), answer.headers.get("Retry-After")

        # Before its aggregate's first: held (409, Retry-After: the relay defers it).
        status, _text, retry_after = await post(webhook_request(early_id, early, body))
        assert (status, retry_after) == (409, "1")
        # What does not verify never reaches the inbox.
        signed = webhook_request(early_id, early, body)
        assert (await post(signed, b'{"aggregate": "agg-0", "k": 100}'))[0] == 401  # body changed
        assert (await post({**signed, "Idempotency-Key": str(uuid.uuid4())}))[0] == 401  # not the signed id
        other = "whsec_" + base64.b64encode(b"another-key-0123456789abcdefghij").decode()
        assert (await post(webhook_request(early_id, early, body, secret=other)))[0] == 401
        stale = datetime.now(UTC) - timedelta(minutes=6)
        assert (await post(webhook_request(early_id, early, body, when=stale)))[0] == 401
        unsigned = {k: v for k, v in signed.items() if not k.startswith("webhook-")}
        assert (await post(unsigned))[0] == 401
        no_aggregate = {k: v for k, v in early.items() if k != "aggregate_id"}
        assert (await post(webhook_request(early_id, no_aggregate, body)))[0] == 400

        # The relay delivers everything, signed with its own implementation.
        events = write(names, producer_dsn)
        secrets = tmp_path / "secrets"
        secrets.write_text(SECRET + "\n")
        relay = Relay(dsn=relay_dsn, schema=names.schema, broker="http", url=receiver,
                      webhook_secret_file=str(secrets), poll_interval="50ms")  # fmt: skip
        await deliver(db, relay, len(events))
        check(dsn, events)

        # Every event again, as a retry would send it: a duplicate, answered 200.
        rows = db.conn.execute(
            f"SELECT event_id::text, aggregate_id, aggregate_seq, aggregate_epoch, payload::text"
            f' FROM "{names.schema}"."{names.table}"'
        ).fetchall()
        for event_id, aggregate_id, seq, epoch, payload in rows:
            fields = {"aggregate_id": aggregate_id, "aggregate_type": "order", "event_type": "OrderChanged",
                      "aggregate_seq": str(seq), "aggregate_epoch": epoch}  # fmt: skip
            data = payload.encode()
            assert await post(webhook_request(event_id, fields, data), data) == (200, "duplicate", None)
    check(dsn, events)


def test_the_relays_field_headers_are_what_the_receiver_reads() -> None:
    from relay.adapters.http.publisher import FIELD_HEADERS

    for field, header in FIELD_HEADERS.items():
        assert header.lower() == "relay-" + field.replace("_", "-")


def test_a_request_signed_by_the_relay_reads_back_and_rotation_verifies_with_either_secret() -> None:
    from relay.adapters.http.signing import parse_secrets, signature

    old = "whsec_" + base64.b64encode(b"old-key-0123456789abcdefghijklmn").decode()
    event_id, now = str(uuid.uuid4()), 1_700_000_000
    body = json.dumps({"k": 1}).encode()
    headers = {
        "Idempotency-Key": event_id, "Relay-Aggregate-Id": "a", "Relay-Event-Type": "E", "Relay-Aggregate-Seq": "3",
        "Relay-Aggregate-Epoch": "1.1.n7", "Relay-Outbox-Id": "12", "tenant": "acme", "webhook-id": event_id,
        "webhook-timestamp": str(now), "webhook-signature": signature(parse_secrets(f"{old} {SECRET}", "t"),
                                                                      event_id, now, body),
    }  # fmt: skip
    for secrets in (old, SECRET, f"{SECRET} {old}"):
        got = received_from_webhook(headers, body, secrets=secrets, now=now + 10)
        assert (str(got.event_id), got.aggregate_id, got.aggregate_seq, got.aggregate_epoch, got.outbox_id) == (
            event_id, "a", 3, "1.1.n7", 12,
        )  # fmt: skip
        assert got.headers == {"tenant": "acme"} and got.payload() == {"k": 1}
    unsigned = {k: v for k, v in headers.items() if not k.startswith("webhook-")}
    assert received_from_webhook(unsigned, body, secrets=None).event_id == uuid.UUID(event_id)
    with pytest.raises(WebhookRejected) as refused:
        received_from_webhook(unsigned, body, secrets=SECRET)
    assert refused.value.status == 401
    with pytest.raises(ValueError, match="not whsec_"):
        received_from_webhook(headers, body, secrets="whsec_not base64!", now=now)


async def test_apply_is_what_another_framework_calls(consumer_db: tuple[str, AsyncConnectionPool[Any]]) -> None:
    _dsn, pool = consumer_db
    consumer = consumer_of(pool)

    def event(seq: int) -> Received:
        return Received(uuid.uuid4(), "order", "x", "E", b'{"k": 0}', aggregate_seq=seq, aggregate_epoch="1.1.n1")

    first, second = event(1), event(2)
    assert await consumer.apply(second) is Verdict.OUT_OF_ORDER
    assert await consumer.apply(first) is Verdict.APPLIED
    assert await consumer.apply(first) is Verdict.DUPLICATE
    assert await consumer.apply(second) is Verdict.APPLIED


async def test_a_failing_handler_rolls_its_receipt_back_and_the_message_comes_again(
    consumer_db: tuple[str, AsyncConnectionPool[Any]],
) -> None:
    _dsn, pool = consumer_db
    fails = [True]

    async def flaky(conn: psycopg.AsyncConnection[Any], event: Received) -> None:
        await record(conn, event)
        if fails.pop(0) if fails else False:
            raise RuntimeError("the effect's own failure")

    consumer = Consumer(pool, Inbox(), flaky)
    e = Received(uuid.uuid4(), "order", "y", "E", b'{"k": 1}')
    with pytest.raises(RuntimeError):
        await consumer.apply(e)
    assert await consumer.apply(e) is Verdict.APPLIED  # nothing was recorded the first time


async def test_a_failed_receive_is_asked_again_not_the_end_of_the_runner(
    sqs_client: Any, make_queue: Callable[..., str], consumer_db: tuple[str, AsyncConnectionPool[Any]]
) -> None:
    from botocore.exceptions import EndpointConnectionError

    dsn, pool = consumer_db
    url = make_queue(fifo=False)
    event_id = str(uuid.uuid4())
    fields = {"event_id": event_id, "aggregate_id": "z", "event_type": "E"}
    attributes = {name: {"DataType": "String", "StringValue": value} for name, value in fields.items()}
    sqs_client.send_message(QueueUrl=url, MessageBody='{"k": 1}', MessageAttributes=attributes)

    class Flaky:
        """The moto client, its first receive failing as an unreachable endpoint does."""

        failures = 1

        def __getattr__(self, name: str) -> Any:
            return getattr(sqs_client, name)

        def receive_message(self, **kwargs: Any) -> Any:
            if self.failures:
                self.failures -= 1
                raise EndpointConnectionError(endpoint_url=url)
            return sqs_client.receive_message(**kwargs)

    running = asyncio.create_task(consumer_of(pool).run_sqs(Flaky(), url, wait_seconds=1))
    try:
        assert await wait_until_async(lambda: len(effects(dsn)) == 1 or running.done(), 10)
        assert not running.done()
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
