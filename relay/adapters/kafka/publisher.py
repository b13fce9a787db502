"""The Kafka publisher: aiokafka's idempotent producer (``acks=all``), one record per
message, keyed by the aggregate id."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer, errors
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest

from relay.adapters.kafka.classify import classify
from relay.adapters.kafka.settings import KafkaSettings
from relay.adapters.quiet_logs import QuietLines
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.adapters.kafka")

CONNECT_RETRY_DELAYS_S = (0.5, 1.0, 2.0)
# Kafka's error codes in a metadata answer that say something about the topic itself.
UNKNOWN_TOPIC = 3
TOPIC_AUTHORIZATION_FAILED = 29
# How long a topic found missing is not looked up again (its messages wait meanwhile;
# the worker's own backoff spaces the claims anyway).
MISSING_RECHECK_S = 1.0


class QuietConnects(QuietLines):
    """Drops aiokafka's line for each failed connection and metadata request, each an
    ERROR, repeated on every try while a broker is down: the relay says an outage once,
    with the broker's reason, and refuses to start with one line."""

    LOGGERS = ("aiokafka", "aiokafka.producer.sender")
    PREFIXES = ("Unable connect to", "Unable to request metadata", "Unexpected error during InitProducerIdRequest")


class KafkaPublisher:
    name = "kafka"

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._quiet = QuietConnects()
        self._producer: AIOKafkaProducer | None = None
        self._topic_known = False
        self._missing: tuple[float, BrokerUnavailable] | None = None

    def _make_producer(self) -> AIOKafkaProducer:
        s = self.settings
        extra: dict[str, Any] = {}
        if s.security_protocol in ("SSL", "SASL_SSL"):
            extra["ssl_context"] = create_ssl_context(cafile=s.ca_file)
        if s.security_protocol.startswith("SASL"):
            extra.update(
                sasl_mechanism=s.sasl_mechanism,
                sasl_plain_username=s.sasl_username,
                sasl_plain_password=s.sasl_password,
            )
        return AIOKafkaProducer(
            bootstrap_servers=list(s.bootstrap_servers),
            client_id=s.client_id,
            # Idempotent: a retry inside the producer never writes a record twice or out of
            # order within its partition. It needs acks=all.
            acks="all",
            enable_idempotence=True,
            max_request_size=s.max_message_bytes,
            request_timeout_ms=max(int(s.request_timeout.total_seconds() * 1000), 1),
            security_protocol=s.security_protocol,
            **extra,
        )

    async def start(self) -> None:
        """Connect (a short retry, then ``ConfigError``). A missing topic is not an error
        here: it may be created after the relay starts; its messages wait meanwhile."""
        self._quiet.install()
        last: BaseException | None = None
        for attempt in range(len(CONNECT_RETRY_DELAYS_S) + 1):
            if attempt:
                await asyncio.sleep(CONNECT_RETRY_DELAYS_S[attempt - 1])
            producer = self._make_producer()
            try:
                await producer.start()
            except Exception as exc:  # aiokafka raises KafkaError subclasses and OSErrors alike
                last = exc
                await producer.stop()
                continue
            self._producer = producer
            log.info(
                "connected to Kafka at %s: topic %s", ",".join(self.settings.bootstrap_servers), self.settings.topic
            )
            return
        servers = ",".join(self.settings.bootstrap_servers)
        said = mask(first_line(last or "no answer"))
        if last is not None and not isinstance(last, errors.KafkaConnectionError | OSError):
            # Reached, and refused: InitProducerId fails on brokers without idempotent
            # producers (tansu 0.6 answers UnknownError).
            raise ConfigError(
                f"Kafka at {servers} refused the producer ({type(last).__name__}: {said}): the relay needs"
                " a broker that takes idempotent producers (enable.idempotence with acks=all)"
            )
        raise ConfigError(f"cannot reach Kafka at {servers}: {said}")

    async def close(self) -> None:
        if self._producer is not None:
            # stop() flushes what is queued: nothing in flight is lost.
            await self._producer.stop()
            self._producer = None
        self._quiet.remove()

    async def _topic(self) -> tuple[DestinationState, str]:
        """The topic as a metadata request that may not create it finds it. The producer's
        own requests would create a missing topic on a broker with
        auto.create.topics.enable (Kafka's default) with the broker's default partitions:
        the relay asks first, and sends only to a topic that exists."""
        producer = self._producer
        if producer is None:
            return DestinationState.UNREACHABLE, "not connected"
        node = producer.client.get_random_node()
        if node is None:
            return DestinationState.UNREACHABLE, "no broker known"
        request = MetadataRequest([self.settings.topic], allow_auto_topic_creation=False)
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                response = await producer.client.send(node, request)
        except TimeoutError:
            return DestinationState.UNREACHABLE, f"no metadata answer within {CHECK_TIMEOUT_S:g}s"
        except Exception as exc:  # a lost connection, a broker going away
            return DestinationState.UNREACHABLE, mask(first_line(exc))
        code = response.topics[0][0] if response.topics else UNKNOWN_TOPIC
        if code == 0:
            return DestinationState.EXISTS, ""
        if code == UNKNOWN_TOPIC:
            return DestinationState.MISSING, "no such topic (the relay never creates topics)"
        if code == TOPIC_AUTHORIZATION_FAILED:
            return DestinationState.DENIED, "not authorized for this topic"
        return DestinationState.UNREACHABLE, f"metadata error code {code}"

    async def _ready(self) -> BrokerUnavailable | None:
        """None once the topic is known to exist; else why its messages wait."""
        if self._topic_known:
            return None
        now = time.monotonic()
        if self._missing is not None and now - self._missing[0] < MISSING_RECHECK_S:
            return self._missing[1]
        state, reason = await self._topic()
        if state is DestinationState.EXISTS:
            self._topic_known, self._missing = True, None
            return None
        refusal = BrokerUnavailable(f"{self.settings.where} {state.value}: {reason}")
        self._missing = (now, refusal)
        return refusal

    def _headers(self, m: OutboxMessage) -> list[tuple[str, bytes]]:
        return [(name, str(value).encode()) for name, value in m.envelope().items()]

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        producer = self._producer
        if producer is None:
            return [BrokerUnavailable("the Kafka publisher is not started")] * len(batch)
        refusal = await self._ready()
        if refusal is not None:
            return [refusal] * len(batch)
        where = self.settings.where
        outcomes: list[Outcome] = [None] * len(batch)
        sent: list[tuple[int, asyncio.Future[Any]]] = []
        # Every record is queued first (the producer batches them per partition), then
        # every acknowledgement awaited: only an acknowledged record counts as delivered.
        for i, m in enumerate(batch):
            try:
                future = await producer.send(
                    self.settings.topic, value=m.body, key=m.aggregate_id.encode(), headers=self._headers(m)
                )
            except Exception as exc:  # refused before sending: a record too large
                outcomes[i] = classify(exc, where)
                continue
            sent.append((i, future))
        for i, future in sent:
            try:
                await future
            except Exception as exc:
                outcomes[i] = classify(exc, where)
                if isinstance(outcomes[i], BrokerUnavailable):
                    self._topic_known = False  # deleted, or access withdrawn: look again
        return outcomes

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        state, reason = await self._topic()
        if state is DestinationState.EXISTS:
            self._topic_known = True
            reason = "a metadata request found it"
        return [DestinationCheck(self.settings.where, state, reason)]
