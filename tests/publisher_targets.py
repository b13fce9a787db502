"""The project's harnesses for the publisher conformance suite
(:mod:`relay.testing.conformance`, run by tests/test_publisher_conformance.py): one per
built-in destination, and the in-memory publisher.

Each is a :class:`relay.testing.conformance.Harness` (what it starts, how it reads back
what arrived, what it refuses) built from pytest fixtures the harness names in
``FIXTURES``, so that a run without RabbitMQ still tests the others, and
``RELAY_TEST_REQUIRE_SERVICES=1`` turns a missing service into a failure, never a skip.
``REAL_BROKER`` says whether a real broker (or its server-mode emulator) stands behind
it: every case must run on two real brokers at least.

Adding a destination is one harness class here and one ``TargetSpec`` line per flavour
in ``TARGETS``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote

import boto3

from relay.adapters.aws.entries import LEFT_OUT as AWS_LEFT_OUT
from relay.adapters.http import SPEC as HTTP
from relay.adapters.kafka import SPEC as KAFKA
from relay.adapters.log import LogPublisher
from relay.adapters.nats import SPEC as NATS
from relay.adapters.sns.publisher import SnsPublisher
from relay.adapters.sns.settings import SnsSettings
from relay.adapters.sqs.publisher import SqsPublisher
from relay.adapters.sqs.settings import SqsSettings
from relay.contract import Publisher, PublishLimits
from relay.errors import PermanentError
from relay.message import OutboxMessage
from relay.testing import InMemoryPublisher
from relay.testing.conformance import ARRIVAL_TIMEOUT_S, Delivered, Harness
from tests.pg_clusters import free_port
from tests.rabbitmq_broker import Rabbit, unique
from tests.sqs_server import queue_url, receive_all, unique_queue_name


class Target(Harness):
    """A harness of the project's own, built from the fixtures it names."""

    # A real broker (or its server-mode emulator) stands behind the adapter.
    REAL_BROKER: ClassVar[bool]
    # The pytest fixtures the harness is built from, by name.
    FIXTURES: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        """:param fixtures: the values of the fixtures named in ``FIXTURES``."""
        super().__init__(name)


# What the core tells the adapters built through their spec (HTTP, Kafka, NATS).
LIMITS = PublishLimits(publish_timeout=timedelta(seconds=10), workers=4, batch_size=50)


async def _started(publisher: Publisher) -> Publisher:
    await publisher.start()
    return publisher


@dataclass(frozen=True)
class TargetSpec:
    """One entry of the suite's parametrization: a harness class and its options."""

    name: str  # the test id
    kind: type[Target]
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self, fixtures: Mapping[str, Any]) -> Target:
        return self.kind(self.name, fixtures, **self.options)


# ---------------------------------------------------------------------------------------
# memory


class MemoryTarget(Target):
    """The in-memory publisher: every publisher made delivers into one shared list, and
    its script refuses the messages ``refuse`` marked."""

    REAL_BROKER = False
    REFUSALS = ("scripted",)
    UNSUPPORTED = {
        "missing_destination": "the in-memory publisher has no destination that could be missing"
        " (a scripted BrokerUnavailable would test the script, not an adapter)",
    }

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        super().__init__(name, fixtures)
        self._delivered: list[OutboxMessage] = []
        self._read = 0
        self._refused: set[int] = set()

    async def start_publisher(self) -> Publisher:
        return await _started(InMemoryPublisher(script=self._script, delivered=self._delivered))

    def _script(self, message: OutboxMessage) -> PermanentError | None:
        if message.id in self._refused:
            return PermanentError("refused by the test's script")
        return None

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        self._refused.add(message.id)
        return message

    async def read_delivered(self, expected: int) -> list[Delivered]:
        new, self._read = self._delivered[self._read :], len(self._delivered)
        return [Delivered(m.envelope(), m.body) for m in new]


# ---------------------------------------------------------------------------------------
# log


class LogPublisherTarget(Target):
    """The log broker writing into a file opened as stdout is (text, over a binary buffer),
    read back line by line."""

    REAL_BROKER = False
    FIXTURES = ("tmp_path",)
    UNSUPPORTED = {
        "permanent_failure": "the log broker writes every message it is given: it refuses none",
        "missing_destination": "the log broker writes to stdout, which has no destination that could be missing",
    }

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        super().__init__(name, fixtures)
        self._path: Path = fixtures["tmp_path"] / "log-broker.jsonl"
        self._stream = self._path.open("w", encoding="utf-8")
        self._read = 0

    async def start_publisher(self) -> Publisher:
        return await _started(LogPublisher(self._stream))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        data = self._path.read_bytes()
        end = data.rfind(b"\n") + 1  # whole lines only
        new, self._read = data[self._read : end], max(self._read, end)
        delivered = []
        for line in new.splitlines():
            # The payload is spliced in last as it was claimed (relay.adapters.log): the
            # first top-level `, "payload": ` ends the envelope (inside an envelope value a
            # quote is escaped), and the envelope alone is decoded.
            head, _, payload = line[:-1].partition(b', "payload": ')
            delivered.append(Delivered(json.loads(head + b"}"), payload))
        return delivered

    async def cleanup(self) -> None:
        await super().cleanup()
        self._stream.close()


# ---------------------------------------------------------------------------------------
# RabbitMQ


class RabbitTarget(Target):
    """A topic exchange of the test's own with one queue bound to every routing key; the
    missing destination is an exchange nobody declared."""

    REAL_BROKER = True
    FIXTURES = ("rabbit",)
    # The broker-side refusal (its max_message_size lowered with rabbitmqctl) is global to
    # the shared broker; tests/test_rabbitmq_adapter.py covers it. Here the adapter's own
    # --amqp-max-message-size refuses, as it does for a deployment that sets it.
    REFUSALS = ("over --amqp-max-message-size",)
    MAX_MESSAGE_SIZE = 64 * 1024
    ROUTING_KEY = "{aggregate_type}.{event_type}"

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        super().__init__(name, fixtures)
        self._rabbit: Rabbit = fixtures["rabbit"]
        self._destination: tuple[str, str] | None = None  # (exchange, queue)

    async def _topology(self) -> tuple[str, str]:
        if self._destination is None:
            exchange = await self._rabbit.exchange("topic")
            queue = await self._rabbit.queue(bind=(exchange, "#"))
            self._destination = (exchange, queue)
        return self._destination

    async def start_publisher(self) -> Publisher:
        exchange, _ = await self._topology()
        return await self._on(exchange)

    async def start_missing_destination(self) -> Publisher:
        return await self._on(unique("missing"))

    async def _on(self, exchange: str) -> Publisher:
        # Rabbit.publisher starts it, and closes it when the rabbit fixture is torn down.
        return await self._rabbit.publisher(
            exchange=exchange, routing_key=self.ROUTING_KEY, max_message_size=self.MAX_MESSAGE_SIZE
        )

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        return replace(message, body=_blob(self.MAX_MESSAGE_SIZE + 1))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        _, queue = await self._topology()
        got = await self._rabbit.drain(queue, expected, timeout=ARRIVAL_TIMEOUT_S)
        return [Delivered(_envelope_of(m.headers), bytes(m.body)) for m in got]


# ---------------------------------------------------------------------------------------
# SQS (moto in server mode)


class SqsTarget(Target):
    """A queue of the test's own on moto, standard or FIFO; the missing destination is a
    queue URL on the same server that names no queue."""

    REAL_BROKER = True
    LEFT_OUT = AWS_LEFT_OUT
    FIXTURES = ("moto_endpoint", "sqs_client", "make_queue")
    OVERSIZED = "over --sqs-max-message-size"
    BAD_CHARACTER = "a character SQS does not accept"
    NARROWED = "over the queue's MaximumMessageSize, refused by SQS itself"
    REFUSALS = (OVERSIZED, BAD_CHARACTER, NARROWED)
    MAX_MESSAGE_SIZE = 16 * 1024
    # SQS's smallest MaximumMessageSize; the queue is narrowed to it after the publisher
    # read the queue's size at start, so the adapter sends and SQS refuses.
    NARROWED_SIZE = 1024

    def __init__(self, name: str, fixtures: Mapping[str, Any], *, fifo: bool) -> None:
        super().__init__(name, fixtures)
        self._endpoint: str = fixtures["moto_endpoint"]
        self._sqs: Any = fixtures["sqs_client"]
        self._make_queue: Any = fixtures["make_queue"]
        self._fifo = fifo
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            self._url = str(self._make_queue(fifo=self._fifo))
        return self._url

    def _on(self, url: str) -> SqsPublisher:
        settings = SqsSettings(
            queue_url=url,
            region="us-east-1",
            endpoint_url=self._endpoint,
            # No SDK retry: a retried call that reached moto would be a duplicate on a
            # standard queue. The read timeout allows for a loaded machine.
            sdk_attempts=1,
            read_timeout_s=10.0,
            max_message_bytes=self.MAX_MESSAGE_SIZE,
        )
        return SqsPublisher(settings, session=boto3.session.Session())

    async def start_publisher(self) -> Publisher:
        return await _started(self._on(self.url))

    async def start_missing_destination(self) -> Publisher:
        return await _started(self._on(queue_url(self._endpoint, unique_queue_name(self._fifo))))

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        if kind == self.OVERSIZED:
            return replace(message, body=_blob(self.MAX_MESSAGE_SIZE + 1))
        if kind == self.BAD_CHARACTER:
            return replace(message, body='{"text": "\uffff"}'.encode())
        assert kind == self.NARROWED, kind
        self._sqs.set_queue_attributes(QueueUrl=self.url, Attributes={"MaximumMessageSize": str(self.NARROWED_SIZE)})
        return replace(message, body=_blob(2 * self.NARROWED_SIZE))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        return await read_queue(self._sqs, self.url, expected)


class SnsTarget(Target):
    """A topic of the test's own on moto, standard or FIFO, with an SQS queue subscribed by
    raw delivery (so the message attributes arrive as the queue's); the missing
    destination is a topic ARN nobody created."""

    REAL_BROKER = True
    LEFT_OUT = AWS_LEFT_OUT
    FIXTURES = ("moto_endpoint", "sqs_client", "make_topic")
    OVERSIZED = "over the adapter's message size limit"
    REFUSALS = (OVERSIZED,)
    MAX_MESSAGE_SIZE = 16 * 1024

    def __init__(self, name: str, fixtures: Mapping[str, Any], *, fifo: bool) -> None:
        super().__init__(name, fixtures)
        self._endpoint: str = fixtures["moto_endpoint"]
        self._sqs: Any = fixtures["sqs_client"]
        self._make_topic: Any = fixtures["make_topic"]
        self._fifo = fifo
        self._topic: Any = None

    @property
    def topic(self) -> Any:
        if self._topic is None:
            self._topic = self._make_topic(fifo=self._fifo)
        return self._topic

    def _on(self, arn: str) -> SnsPublisher:
        settings = SnsSettings(
            topic_arn=arn,
            region="us-east-1",
            endpoint_url=self._endpoint,
            sdk_attempts=1,  # a retried call that reached moto would be a duplicate
            read_timeout_s=10.0,
            max_message_bytes=self.MAX_MESSAGE_SIZE,
        )
        return SnsPublisher(settings, session=boto3.session.Session())

    async def start_publisher(self) -> Publisher:
        return await _started(self._on(self.topic.arn))

    async def start_missing_destination(self) -> Publisher:
        name = f"missing-{unique('t')}" + (".fifo" if self._fifo else "")
        return await _started(self._on(f"arn:aws:sns:us-east-1:123456789012:{name}"))

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        assert kind == self.OVERSIZED, kind
        return replace(message, body=_blob(self.MAX_MESSAGE_SIZE + 1))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        return await read_queue(self._sqs, self.topic.queue_url, expected)


async def read_queue(sqs_client: Any, url: str, expected: int) -> list[Delivered]:
    """What an SQS consumer of ``url`` got since the last read (read and deleted), the
    attributes typed back by their DataType. Also for a queue subscribed to an SNS topic
    with raw message delivery, where SNS's message attributes arrive as the queue's."""
    got = []
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while True:
        got += await asyncio.to_thread(receive_all, sqs_client, url)
        if len(got) >= expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    got += await asyncio.to_thread(receive_all, sqs_client, url, idle_s=0.2)
    delivered = []
    for r in got:
        envelope: dict[str, str | int] = {}
        for name, value in r.attributes.items():
            data_type = r.data_types[name]
            assert data_type in ("Number", "String"), f"attribute {name} has DataType {data_type}"
            envelope[name] = int(value) if data_type == "Number" else value
        delivered.append(Delivered(envelope, r.body.encode()))
    return delivered


# ---------------------------------------------------------------------------------------
# HTTP (a receiver process, tests/http_receiver.py)


class HttpTarget(Target):
    """A webhook receiver in its own process recording every request in PostgreSQL; the
    missing destination is a port nothing listens on. The receiver answers 422 to the
    event type ``refuse`` gives a message, as an API refuses a request it finds invalid."""

    REAL_BROKER = True
    FIXTURES = ("pg_dsn", "tmp_path")
    REFUSALS = ("422 from the receiver",)
    REFUSED_TYPE = "RefusedByTheReceiver"
    # What the HTTP client and the relay add that is no envelope field.
    TRANSPORT = frozenset(
        {"host", "user-agent", "accept", "accept-encoding", "content-length", "content-type", "idempotency-key"}
    )
    NUMBERS = frozenset({"outbox_id", "attempt", "lease_version", "aggregate_seq"})

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        from tests.http_receiver import Receiver  # starts a process: only when this target runs

        super().__init__(name, fixtures)
        script = {self.REFUSED_TYPE: [{"status": 422, "body": "refused by the test's receiver"}]}
        self._receiver = Receiver(fixtures["pg_dsn"], fixtures["tmp_path"], RECEIVER_SCRIPT=json.dumps(script))
        self._read = 0

    async def start_publisher(self) -> Publisher:
        return await self._on(self._receiver.url)

    async def start_missing_destination(self) -> Publisher:
        return await self._on(f"http://127.0.0.1:{free_port()}/nothing-listens-here")

    async def _on(self, url: str) -> Publisher:
        return await _started(HTTP.create({"url": url}, LIMITS))

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        return replace(message, event_type=self.REFUSED_TYPE)

    async def read_delivered(self, expected: int) -> list[Delivered]:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while True:
            rows = await asyncio.to_thread(self._delivered)
            if len(rows) >= expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        rows = await asyncio.to_thread(self._delivered)
        self._read += len(rows)
        return [Delivered(self._envelope(headers), body.encode()) for headers, body in rows]

    def _delivered(self) -> list[tuple[dict[str, str], str]]:
        rows = self._receiver.query(
            f"SELECT headers, body FROM requests WHERE status = 200 ORDER BY n OFFSET {self._read}"
        )
        return [(dict(h), str(b)) for h, b in rows]

    def _envelope(self, headers: Mapping[str, str]) -> dict[str, str | int]:
        envelope: dict[str, str | int] = {}
        for name, value in headers.items():
            lower = name.lower()
            if lower in self.TRANSPORT or lower.startswith("webhook-"):
                continue
            if lower.startswith("relay-"):
                field_name = lower[len("relay-") :].replace("-", "_")
                text = unquote(value)
                envelope[field_name] = int(text) if field_name in self.NUMBERS else text
            else:
                envelope[name] = unquote(value)
        return envelope

    async def cleanup(self) -> None:
        await super().cleanup()
        await asyncio.to_thread(self._receiver.close)


# ---------------------------------------------------------------------------------------
# Kafka (noida-db, tests/kafka_broker.py)


class KafkaTarget(Target):
    """A topic of the test's own on the session's Kafka-protocol broker, read back from the
    beginning; the missing destination is a topic nobody created (the relay never creates
    one); the refusal is the adapter's own --kafka-max-message-size, as on RabbitMQ."""

    REAL_BROKER = True
    FIXTURES = ("kafka",)
    REFUSALS = ("over --kafka-max-message-size",)
    MAX_MESSAGE_SIZE = 16 * 1024
    NUMBERS = frozenset({"outbox_id", "attempt", "lease_version", "aggregate_seq"})

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        super().__init__(name, fixtures)
        self._kafka = fixtures["kafka"]
        self._topic: str | None = None
        # (partition, offset) of every record read already: a read lists the topic
        # partition by partition, so a new record can come before old ones in it.
        self._seen: set[tuple[int, int]] = set()

    async def _on(self, topic: str) -> Publisher:
        values = {
            "bootstrap_servers": self._kafka.bootstrap,
            "topic": topic,
            "kafka_max_message_size": self.MAX_MESSAGE_SIZE,
        }
        return await _started(KAFKA.create(values, LIMITS))

    async def start_publisher(self) -> Publisher:
        if self._topic is None:
            created: str = await asyncio.to_thread(self._kafka.create_topic, 3)
            self._topic = created
            return await self._on(created)
        return await self._on(self._topic)

    async def start_missing_destination(self) -> Publisher:
        return await self._on(unique("missing"))

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        return replace(message, body=_blob(self.MAX_MESSAGE_SIZE + 1))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        assert self._topic is not None
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while True:
            records = await asyncio.to_thread(self._kafka.read, self._topic, idle_s=0.3)
            new = [r for r in records if (r.partition, r.offset) not in self._seen]
            if len(new) >= expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        self._seen.update((r.partition, r.offset) for r in new)
        # A consumer reads partition by partition: arrival order across partitions is not
        # defined, so the suite's checks (by id) see them in id order.
        new.sort(key=lambda r: int(r.headers["outbox_id"]))
        return [Delivered(self._envelope(r.headers), bytes(r.value)) for r in new]

    def _envelope(self, headers: Mapping[str, str]) -> dict[str, str | int]:
        return {k: int(v) if k in self.NUMBERS else v for k, v in headers.items()}


# ---------------------------------------------------------------------------------------
# NATS JetStream (the local nats-server, tests/nats_server.py)


class NatsTarget(Target):
    """A stream of the test's own, read back from its first message; the missing
    destination is a subject no stream captures; the refusal is a message over the
    server's max_payload."""

    REAL_BROKER = True
    FIXTURES = ("nats_stream",)
    REFUSALS = ("over the server's max_payload",)
    NUMBERS = frozenset({"outbox_id", "attempt", "lease_version", "aggregate_seq"})

    def __init__(self, name: str, fixtures: Mapping[str, Any]) -> None:
        super().__init__(name, fixtures)
        self._stream = fixtures["nats_stream"]
        self._created = False
        self._read = 0

    async def _on(self, subject: str) -> Publisher:
        values = {"nats_url": self._stream.url, "subject": subject}
        return await _started(NATS.create(values, LIMITS))

    async def start_publisher(self) -> Publisher:
        if not self._created:
            await asyncio.to_thread(self._stream.create)
            self._created = True
        return await self._on(self._stream.subject("conformance"))

    async def start_missing_destination(self) -> Publisher:
        return await self._on(unique("missing").replace("-", "_"))

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        return replace(message, body=_blob(1_100_000))

    async def read_delivered(self, expected: int) -> list[Delivered]:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        while True:
            got = await asyncio.to_thread(self._stream.read)
            if len(got) - self._read >= expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        new, self._read = got[self._read :], len(got)
        return [Delivered(self._envelope(m.headers), bytes(m.data)) for m in new]

    def _envelope(self, headers: Mapping[str, str]) -> dict[str, str | int]:
        return {k: int(v) if k in self.NUMBERS else unquote(v) for k, v in headers.items() if k != "Nats-Msg-Id"}


def _envelope_of(headers: Mapping[str, object]) -> dict[str, str | int]:
    """AMQP headers as the envelope: each value must have come back a text or an integer."""
    envelope: dict[str, str | int] = {}
    for name, value in headers.items():
        assert isinstance(value, str | int) and not isinstance(value, bool), f"header {name} is {value!r}"
        envelope[name] = value
    return envelope


def _blob(size: int) -> bytes:
    """A JSON payload of ``size`` bytes or a little more."""
    return json.dumps({"blob": "x" * size}).encode()


# The suite's parametrization: one line per adapter flavour.
TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec("memory", MemoryTarget),
    TargetSpec("log", LogPublisherTarget),
    TargetSpec("rabbitmq", RabbitTarget),
    TargetSpec("sqs-standard", SqsTarget, {"fifo": False}),
    TargetSpec("sqs-fifo", SqsTarget, {"fifo": True}),
    TargetSpec("sns-standard", SnsTarget, {"fifo": False}),
    TargetSpec("sns-fifo", SnsTarget, {"fifo": True}),
    TargetSpec("http", HttpTarget),
    TargetSpec("kafka", KafkaTarget),
    TargetSpec("nats", NatsTarget),
)
