"""The Kafka publisher's producer, driven directly against the session's Kafka-protocol
broker (tests/kafka_broker.py): it never creates a topic, whatever request it makes, and a
producer whose idempotence state the broker no longer has is replaced once, its messages
held (no attempt spent) meanwhile. The oracle is the broker: its topics and what they hold.
And, without a broker, how those errors are sorted and how a partition count change is said.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import errors
from aiokafka.conn import AIOKafkaConnection
from aiokafka.protocol.metadata import MetadataRequest, MetadataRequest_v5

from relay.adapters.kafka.classify import classify, lost_producer_state
from relay.adapters.kafka.publisher import KafkaPublisher
from relay.adapters.kafka.settings import KafkaSettings
from relay.adapters.kafka.topic import PartitionWatch
from relay.contract import TIMEOUT_PREFIX, Outcome, PublishLimits, publish_within
from relay.errors import BrokerUnavailable, NotSent, RetryableError
from relay.message import OutboxMessage
from tests.kafka_broker import KafkaService

PUBLISH_TIMEOUT_S = 3.0


def message(i: int) -> OutboxMessage:
    return OutboxMessage(
        id=i, aggregate_type="order", aggregate_id=f"order-{i}", event_type="OrderPlaced",
        body=b'{"i": %d}' % i, attempt=1, lease_version=1, ordered=False, event_id=f"event-{i}",
    )  # fmt: skip


@pytest.fixture
def metadata_requests(monkeypatch: pytest.MonkeyPatch) -> list[MetadataRequest]:
    """Every metadata request any aiokafka connection of this process sends, as built
    (every request aiokafka makes goes through AIOKafkaConnection.send)."""
    sent: list[MetadataRequest] = []
    original = AIOKafkaConnection.send

    def send(self: AIOKafkaConnection, request: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(request, MetadataRequest):
            sent.append(request)
        return original(self, request, *args, **kwargs)

    monkeypatch.setattr(AIOKafkaConnection, "send", send)
    return sent


@pytest.fixture
async def topic_publisher(kafka: KafkaService) -> AsyncIterator[tuple[str, KafkaPublisher]]:
    topic = await asyncio.to_thread(kafka.create_topic, 3)
    limits = PublishLimits(publish_timeout=timedelta(seconds=PUBLISH_TIMEOUT_S), workers=2, batch_size=50)
    values = {"bootstrap_servers": kafka.bootstrap, "topic": topic}
    publisher = KafkaPublisher(KafkaSettings.from_values(values, limits))
    await publisher.start()
    try:
        yield topic, publisher
    finally:
        await publisher.close()


async def publish(publisher: KafkaPublisher, ids: Iterable[int]) -> list[Outcome]:
    return await publish_within(publisher, [message(i) for i in ids], PUBLISH_TIMEOUT_S)


async def test_no_request_of_the_producer_may_create_a_deleted_topic(
    kafka: KafkaService, topic_publisher: tuple[str, KafkaPublisher], metadata_requests: list[MetadataRequest]
) -> None:
    """The topic deleted under a publisher that has sent to it: its next publishes are
    held (BrokerUnavailable), the producer's own metadata refresh for the topic runs, and
    the topic is still gone: every metadata request naming topics said
    allow_auto_topic_creation=false (as built at v5, the version noida-db answers)."""
    topic, publisher = topic_publisher
    assert await publish(publisher, range(1, 7)) == [None] * 6
    await asyncio.to_thread(kafka.delete_topic, topic)
    for _ in range(2):  # the producer that sent to it, then (if it was replaced) a fresh one
        outcomes = await publish(publisher, range(7, 10))
        assert all(isinstance(o, BrokerUnavailable) for o in outcomes), outcomes
        await asyncio.sleep(1.1)  # past the look's cache
    # The refresh a producer runs for the topics it sends to (on a stale partition, and
    # every 5 minutes).
    producer = publisher._producer
    assert producer is not None
    await producer.client.add_topic(topic)
    await producer.client.force_metadata_update()
    assert await asyncio.to_thread(kafka.partitions, topic) is None
    named = [r for r in metadata_requests if r.build(MetadataRequest_v5).topics]
    assert named, "no metadata request named the topic: the test proves nothing"
    assert [r for r in named if r.build(MetadataRequest_v5).allow_auto_topic_creation] == []
    # Back, it takes the held messages.
    await asyncio.to_thread(kafka.create_topic, 3, topic)
    await asyncio.sleep(1.1)
    assert await publish(publisher, range(7, 10)) == [None] * 3
    assert sorted(int(r.headers["outbox_id"]) for r in await asyncio.to_thread(kafka.read, topic)) == [7, 8, 9]


async def test_a_producer_whose_sequence_numbers_the_broker_lost_is_replaced_once(
    kafka: KafkaService,
    topic_publisher: tuple[str, KafkaPublisher],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The topic deleted and created again at once, behind the publisher's back: the
    broker's partitions start from sequence 0 while the producer goes on from where it was
    (OutOfOrderSequenceNumber, for ever: a fresh producer succeeds at once). Two publishes
    meeting it together replace the producer once; their messages are held, not charged;
    the next publish delivers them."""
    topic, publisher = topic_publisher
    made = 0
    make = publisher._make_producer

    def counting() -> Any:
        nonlocal made
        made += 1
        return make()

    monkeypatch.setattr(publisher, "_make_producer", counting)
    assert await publish(publisher, range(1, 31)) == [None] * 30
    await asyncio.to_thread(kafka.delete_topic, topic)
    await asyncio.to_thread(kafka.create_topic, 3, topic)
    first, second = await asyncio.gather(publish(publisher, range(31, 46)), publish(publisher, range(46, 61)))
    outcomes = [*first, *second]
    assert all(o is None or isinstance(o, BrokerUnavailable) for o in outcomes), outcomes
    assert any(isinstance(o, BrokerUnavailable) for o in outcomes), "no message met the lost state"
    held = [i for i, o in zip(range(31, 61), outcomes, strict=True) if o is not None]
    assert await publish(publisher, held) == [None] * len(held)
    replaced = [r for r in caplog.records if r.getMessage().startswith("Kafka producer for")]
    assert made == 1 and len(replaced) == 1, (made, [r.getMessage() for r in replaced])
    ids = [int(r.headers["outbox_id"]) for r in await asyncio.to_thread(kafka.read, topic)]
    assert sorted(ids) == list(range(31, 61)), ids


@pytest.mark.parametrize(
    "error",
    [
        errors.OutOfOrderSequenceNumber(),
        errors.UnknownProducerId(),
        errors.InvalidProducerEpoch(),
        errors.ProducerFenced(),
        errors.InvalidProducerIdMapping(),
    ],
    ids=lambda e: type(e).__name__,
)
def test_lost_producer_state_is_never_charged(error: Exception) -> None:
    """Whatever path an idempotence-state error takes, it holds the message: the
    publisher replaces the producer, and even unreplaced it is no retryable failure."""
    assert lost_producer_state(error)
    assert isinstance(classify(error, "Kafka topic 't' at k:9092"), BrokerUnavailable)


def test_a_partition_count_change_is_a_warning_once_per_count(caplog: pytest.LogCaptureFixture) -> None:
    watch = PartitionWatch("Kafka topic 't' at k:9092")
    for count in (3, 3, 0, 4, 4, 3, 6):
        watch.saw(count)
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 2 and "has 4 partitions, the relay first saw 3" in said[0] and "has 6" in said[1], said


class FakeCluster:
    def brokers(self) -> list[Any]:
        return [SimpleNamespace(nodeId=1)]

    def partitions_for_topic(self, topic: str) -> set[int]:
        return {0, 1, 2}


class FakeClient:
    """A client whose metadata answer is ``answer``: the topic's (code 0, 3 partitions), or
    an exception (no broker answers)."""

    def __init__(self, answer: Exception | None) -> None:
        self.cluster = FakeCluster()
        self.answer = answer

    async def send(self, node: int, request: Any, **kwargs: Any) -> Any:
        if self.answer is not None:
            raise self.answer
        return SimpleNamespace(topics=[(0, "t", False, [(0, p, 1, [1], [1], []) for p in range(3)])])


class FakeProducer:
    """Queues every record (or, ``room=False``, waits for room for ever) and never
    acknowledges one: a broker that has gone quiet."""

    def __init__(self, client: FakeClient, *, room: bool = True) -> None:
        self.client = client
        self.room = room

    async def send(self, topic: str, **kwargs: Any) -> asyncio.Future[Any]:
        if not self.room:
            await asyncio.Event().wait()
        return asyncio.get_running_loop().create_future()


def quiet_publisher(producer: FakeProducer) -> KafkaPublisher:
    limits = PublishLimits(publish_timeout=timedelta(seconds=2), workers=1, batch_size=10)
    publisher = KafkaPublisher(KafkaSettings.from_values({"bootstrap_servers": "k:9092", "topic": "t"}, limits))
    publisher._producer, publisher._generation, publisher._verified = producer, 1, True  # type: ignore[assignment]
    return publisher


@pytest.mark.parametrize(
    ("answer", "room", "expected", "replaced"),
    [
        pytest.param(errors.KafkaConnectionError("refused"), True, BrokerUnavailable, True, id="no-broker-answers"),
        pytest.param(None, True, RetryableError, False, id="answers-but-no-ack"),
        pytest.param(None, False, NotSent, False, id="no-room-in-the-producer"),
    ],
)
async def test_records_never_acknowledged_are_sorted_before_the_relays_deadline(
    answer: Exception | None, room: bool, expected: type[Exception], replaced: bool
) -> None:
    """Without a broker: records queued and never acknowledged. No broker answering
    metadata holds them (the breaker's class, no attempt) and drops the producer that holds
    them, at once; a broker that answers makes them a retryable timeout, at the adapter's
    deadline; records the producer never had room for are not sent (attempt refunded).
    Each comes back before the relay's own deadline, which would charge them all."""
    publisher = quiet_publisher(FakeProducer(FakeClient(answer), room=room))
    started = time.monotonic()
    outcomes = await publish_within(publisher, [message(i) for i in range(3)], 2.0)
    took = time.monotonic() - started
    assert all(type(o) is expected for o in outcomes), outcomes
    assert took < 2.0 and not any(TIMEOUT_PREFIX in str(o) for o in outcomes), (took, outcomes)
    if expected is BrokerUnavailable:
        assert took < 1.5, f"held only after {took:.1f}s: the look should end the wait"
    assert (publisher._producer is None) is replaced
