"""The Kafka publisher: aiokafka's idempotent producer (``acks=all``), one record per
message, keyed by the aggregate id.

What it does about the broker's faults, so that they hold messages (``BrokerUnavailable``:
no attempt spent, the breaker opens) instead of charging them:

- **No broker answers**: records whose acknowledgement is late make the publisher look at
  the topic with a metadata request on a connection of its own (:func:`topic.look`);
  if no broker answers it, their messages are held, and the producer holding their
  records is discarded (:func:`producer.discard`), so that it never delivers them after
  the relay has handed them back. All of that happens before the relay's publish deadline
  (:func:`relay.contract.publish_deadline`), which would otherwise cut the publish as a
  retryable timeout. While no producer can be started, messages are held unsent.
- **The topic disappears**: held (a configuration fault) until it exists again; the
  producer that sent to it is discarded (its sequence numbers belong to the partitions
  that went with it). The producer cannot create it again (:mod:`producer`).
- **The broker lost this producer's idempotence state** (it answers
  ``OutOfOrderSequenceNumber``, ``UnknownProducerId``, an epoch error: after a restart
  that lost its log tail, a topic deleted and created again): that producer would fail
  every later send to the partition; it is replaced, once, and its messages held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaProducer, errors
from aiokafka.helpers import create_ssl_context

from relay.adapters.kafka.classify import classify, lost_producer_state, needs_look, said
from relay.adapters.kafka.producer import DISCARD_TIMEOUT_S, Discarded, discard, forget, make_producer
from relay.adapters.kafka.settings import KafkaSettings
from relay.adapters.kafka.topic import PartitionWatch, TopicLook, look
from relay.adapters.outage import OutageLog
from relay.adapters.quiet_logs import QuietLines
from relay.cloudevents import JSON, STRUCTURED_CONTENT_TYPE, binary_headers, body_for
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome, publish_deadline
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, NotSent, PermanentError, RetryableError, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.adapters.kafka")

CONNECT_RETRY_DELAYS_S = (0.5, 1.0, 2.0)
# How long a topic found missing (or a broker found silent) is not looked at again before
# a send (its messages wait meanwhile; the breaker spaces the claims anyway).
MISSING_RECHECK_S = 1.0
# A healthy broker acknowledges within milliseconds: records still unacknowledged this long
# make the publisher ask whether a broker answers at all, while it goes on waiting.
LOOK_AFTER_S = 0.5
# The publisher answers this long before the relay's deadline cuts the publish (and counts
# every message as a retryable timeout): at most half a second, at most 15% of it.
DEADLINE_RESERVE_S = 0.5
DEADLINE_RESERVE_SHARE = 0.15
# Queuing the records (the producer waits for room, or for its topic's partitions) may take
# this share of the time left; the rest is for the acknowledgements, and the look that
# tells why they do not come.
QUEUE_SHARE = 2 / 3
# A record the producer had no room for is tried again this much later (attempt refunded):
# about the time its partition's waiting batch takes to go.
NOT_SENT_DELAY_S = 0.5


class QuietConnects(QuietLines):
    """Drops aiokafka's line for each failed connection, metadata request and produce
    request, each repeated on every try while a broker is down: the relay says an outage
    once (adapters.outage), with the broker's reason, and refuses to start with one line."""

    LOGGERS = ("aiokafka", "aiokafka.producer.sender")
    PREFIXES = (
        "Unable connect to",
        "Unable to request metadata",
        "Unable to update metadata",
        "Unexpected error during InitProducerIdRequest",
        "Got error produce response",
    )


class KafkaPublisher:
    name = "kafka"

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._quiet = QuietConnects()
        # The producer in use, and its generation: a publish that finds its producer broken
        # replaces it only if it is still the one it used (see _retire).
        self._producer: AIOKafkaProducer | None = None
        self._generation = 0
        self._starting = asyncio.Lock()  # one fresh producer at a time, however many publish
        self._discards: set[asyncio.Task[None]] = set()
        # The topic was seen to exist since the last trouble: sends go without a look first.
        self._verified = False
        self._held: tuple[float, BrokerUnavailable] | None = None
        self._partitions = PartitionWatch(settings.where)
        self._outage = OutageLog(log, settings.where)

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
        return make_producer(
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
            self._generation += 1
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
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                # stop() flushes what is queued: nothing acknowledged is lost. A broker that
                # is gone would keep it waiting for ever; past the publish timeout what is
                # left is dropped (its rows were handed back or finalized already).
                async with asyncio.timeout(self.settings.publish_timeout.total_seconds()):
                    await producer.stop()
            except TimeoutError:
                await self._discard(producer, "the relay is stopping")
        if self._discards:
            await asyncio.wait(self._discards, timeout=DISCARD_TIMEOUT_S)
        self._quiet.remove()

    # -- the producer: one in use, replaced when broken ---------------------------------

    async def _current(self, until: float) -> tuple[AIOKafkaProducer, int] | BrokerUnavailable:
        """The producer in use and its generation; a fresh one if the last was retired
        (one publish starts it, the others wait for it), or why there is none by ``until``."""
        producer = self._producer
        if producer is not None:
            return producer, self._generation
        try:
            async with asyncio.timeout_at(until):
                async with self._starting:
                    if self._producer is None:
                        fresh = self._make_producer()
                        try:
                            await fresh.start()
                        except BaseException:
                            self._spawn_discard(fresh, "it did not start")
                            raise
                        self._producer, self._generation = fresh, self._generation + 1
                        self._verified = False
                        log.info("a fresh Kafka producer is connected to %s", self.settings.where)
                    return self._producer, self._generation
        except TimeoutError:
            return self._unreachable("no producer could start before the publish deadline")
        except Exception as exc:  # aiokafka raises KafkaError subclasses and OSErrors alike
            return self._unreachable(f"no producer could start: {said(exc)}")

    def _retire(self, generation: int, why: str) -> None:
        """Drop the producer of ``generation`` if it is still the one in use: the next
        publish starts a fresh one. Synchronous, so that of several publishes that find the
        same producer broken, exactly one retires it (the others see a newer generation)."""
        if generation != self._generation or self._producer is None:
            return
        producer, self._producer = self._producer, None
        self._generation += 1
        self._verified = False
        log.warning("Kafka producer for %s replaced: %s", self.settings.where, why)
        self._spawn_discard(producer, why)

    def _spawn_discard(self, producer: AIOKafkaProducer, why: str) -> None:
        task = asyncio.create_task(self._discard(producer, why))
        self._discards.add(task)
        task.add_done_callback(self._discards.discard)

    async def _discard(self, producer: AIOKafkaProducer, why: str) -> None:
        try:
            async with asyncio.timeout(DISCARD_TIMEOUT_S):
                await discard(producer, why)
        except Exception as exc:  # nothing of it is needed any more: say it, do not raise
            log.debug("discarding a Kafka producer: %s: %s", type(exc).__name__, mask(first_line(exc)))

    # -- the topic ---------------------------------------------------------------------

    async def _look(self, producer: AIOKafkaProducer, timeout_s: float) -> TopicLook:
        found = await look(producer.client, self.settings.topic, timeout_s)
        if found.state is DestinationState.EXISTS:
            self._partitions.saw(found.partitions)
        return found

    def _refusal(self, found: TopicLook) -> BrokerUnavailable:
        if found.state is DestinationState.UNREACHABLE:
            return self._unreachable(found.reason)
        return BrokerUnavailable(f"{self.settings.where} {found.state.value}: {found.reason}")

    def _unreachable(self, why: str) -> BrokerUnavailable:
        return BrokerUnavailable(f"{self.settings.where} unreachable: {why}")

    async def _ready(self, producer: AIOKafkaProducer, until: float) -> BrokerUnavailable | None:
        """None once the topic is known to exist; else why its messages wait. A look after
        any trouble (and at first); a refusal is kept for MISSING_RECHECK_S."""
        if self._verified:
            return None
        loop = asyncio.get_running_loop()
        if self._held is not None and time.monotonic() - self._held[0] < MISSING_RECHECK_S:
            return self._held[1]
        found = await self._look(producer, min(CHECK_TIMEOUT_S, until - loop.time()))
        if found.state is DestinationState.EXISTS:
            self._verified, self._held = True, None
            return None
        refusal = self._refusal(found)
        self._held = (time.monotonic(), refusal)
        return refusal

    # -- publishing --------------------------------------------------------------------

    def _until(self) -> float:
        """The loop time by which publish answers: before the relay's own deadline."""
        timeout = self.settings.publish_timeout.total_seconds()
        cut = publish_deadline()
        if cut is None:  # called outside the relay's publish_within (tests, tools)
            cut = asyncio.get_running_loop().time() + timeout
        return cut - min(DEADLINE_RESERVE_S, timeout * DEADLINE_RESERVE_SHARE)

    def _headers(self, m: OutboxMessage) -> list[tuple[str, bytes]]:
        """The record's headers: the relay's envelope, or the CloudEvents Kafka binding's
        (``ce_`` attributes and ``content-type`` in binary mode; ``content-type`` alone in
        structured mode, the attributes being in the value)."""
        ce = self.settings.cloudevents
        if ce is None:
            return [(name, str(value).encode()) for name, value in m.envelope().items()]
        if ce.structured:
            return [("content-type", STRUCTURED_CONTENT_TYPE.encode())]
        headers = [(name, value.encode()) for name, value in binary_headers(m, ce.source, "ce_").items()]
        return [*headers, ("content-type", JSON.encode())]

    def _value(self, m: OutboxMessage) -> bytes:
        return body_for(m, self.settings.cloudevents)

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        until = self._until()
        current = await self._current(until)
        if isinstance(current, BrokerUnavailable):
            return self._noted([current] * len(batch))
        producer, generation = current
        refusal = await self._ready(producer, until)
        if refusal is not None:
            return self._noted([refusal] * len(batch))
        return self._noted(await self._send(producer, generation, batch, until))

    async def _send(
        self, producer: AIOKafkaProducer, generation: int, batch: Sequence[OutboxMessage], until: float
    ) -> list[Outcome]:
        loop = asyncio.get_running_loop()
        raw, futures = await self._queue(producer, batch, loop.time() + (until - loop.time()) * QUEUE_SHARE)
        unqueued = [i for i in range(len(batch)) if raw[i] is None and i not in futures]
        late, found = await self._acknowledged(producer, futures, raw, unqueued, until)
        if found is None and any(exc is not None and needs_look(exc) for exc in raw):
            # A record failed for want of its partition or broker: which one is it?
            found = await self._look(producer, until - loop.time())
        outcomes = [None if exc is None else self._outcome(exc, found) for exc in raw]
        held = self._late(found)
        for i in late:
            outcomes[i] = held
        if found is not None and found.state is DestinationState.EXISTS:
            # Never queued, with a broker answering: the producer had no room for them (its
            # batches for their partitions still waiting to go) before the deadline. Nothing
            # was sent: no attempt is spent for the producer's own limit.
            for i in unqueued:
                outcomes[i] = NotSent(
                    timedelta(seconds=NOT_SENT_DELAY_S),
                    f"not sent to {self.settings.where}: the producer had no room for it before the publish deadline",
                )

        # A producer that lost its sequence numbers fails every later send to the partition;
        # one whose topic is gone holds numbers of partitions that went with it; and what a
        # producer still holds of messages handed back must never be delivered after them
        # (the relay sends them again): each is dropped, and the next publish starts anew.
        lost = next((exc for exc in raw if exc is not None and lost_producer_state(exc)), None)
        if lost is not None:
            self._retire(generation, f"the broker lost its idempotence state ({type(lost).__name__})")
        elif found is not None and found.state is DestinationState.MISSING:
            self._retire(generation, f"the topic is gone ({found.reason})")
        elif late and isinstance(outcomes[late[0]], BrokerUnavailable):
            self._retire(generation, f"its records wait on a broker that does not answer ({found_reason(found)})")
        if any(o is not None and not isinstance(o, PermanentError) for o in outcomes):
            self._verified = False  # look before the next send
        return outcomes

    async def _queue(
        self, producer: AIOKafkaProducer, batch: Sequence[OutboxMessage], until: float
    ) -> tuple[list[BaseException | None], dict[int, asyncio.Future[Any]]]:
        """Every record queued (the producer batches them per partition): what refused
        each before sending, and the future of each queued one. A record the producer
        could not queue by ``until`` (it waits for its topic's partitions, or for room)
        gets no future and no error: it is late."""
        raw: list[BaseException | None] = [None] * len(batch)
        futures: dict[int, asyncio.Future[Any]] = {}
        try:
            async with asyncio.timeout_at(until):
                for i, m in enumerate(batch):
                    try:
                        futures[i] = await producer.send(
                            self.settings.topic,
                            value=self._value(m),
                            key=m.aggregate_id.encode(),
                            headers=self._headers(m),
                        )
                    except Exception as exc:  # refused before sending: a record too large
                        raw[i] = exc
        except TimeoutError:
            pass
        self._partitions.saw(len(producer.client.cluster.partitions_for_topic(self.settings.topic) or ()))
        return raw, futures

    async def _acknowledged(
        self,
        producer: AIOKafkaProducer,
        futures: dict[int, asyncio.Future[Any]],
        raw: list[BaseException | None],
        unqueued: list[int],
        until: float,
    ) -> tuple[list[int], TopicLook | None]:
        """Wait for the acknowledgements (each one's error goes into ``raw``). Those still
        missing after LOOK_AFTER_S make it look at the topic meanwhile; a look that finds
        no broker answering, or no topic, ends the wait at once. Returns the records with
        no acknowledgement (late, or never queued) and what the look found, if it ended."""
        loop = asyncio.get_running_loop()
        waiting: set[asyncio.Future[Any]] = set(futures.values())
        probe: asyncio.Task[TopicLook] | None = None
        try:
            if waiting:
                _, waiting = await asyncio.wait(waiting, timeout=max(min(LOOK_AFTER_S, until - loop.time()), 0))
            if waiting or unqueued:
                probe = asyncio.create_task(self._look(producer, until - loop.time()))
            # Until every acknowledgement is in (and the look, if a record never got queued),
            # the look finds nothing to wait for, or the deadline.
            while probe is not None and loop.time() < until:
                if probe.done() and (not waiting or probe.result().state is not DestinationState.EXISTS):
                    break
                watched = waiting if probe.done() else {*waiting, probe}
                done, _ = await asyncio.wait(watched, timeout=until - loop.time(), return_when=FIRST_COMPLETED)
                waiting -= done
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
        for i, future in futures.items():
            if future in waiting or future.cancelled():  # a cancelled one says no more than a late one
                waiting.add(future)
                forget(future)
            else:
                raw[i] = future.exception()
        late = sorted([i for i, future in futures.items() if future in waiting] + unqueued)
        return late, probe.result() if probe is not None and probe.done() and not probe.cancelled() else None

    def _outcome(self, exc: BaseException, found: TopicLook | None) -> Outcome:
        """The outcome of a record that failed with ``exc``."""
        where = self.settings.where
        if isinstance(exc, Discarded):
            return BrokerUnavailable(f"{where} producer replaced: {exc}; the message was not sent")
        if lost_producer_state(exc):
            return BrokerUnavailable(
                f"{where} lost producer state: the broker no longer has this producer's sequence numbers"
                f" ({type(exc).__name__}); a fresh producer takes its messages"
            )
        if found is not None and found.state is not DestinationState.EXISTS and needs_look(exc):
            return self._refusal(found)
        return classify(exc, where)

    def _late(self, found: TopicLook | None) -> Outcome:
        """The outcome of a record with no acknowledgement by the deadline."""
        if found is None:  # the look itself had no answer yet
            return self._unreachable("no broker answered metadata before the publish deadline")
        if found.state is not DestinationState.EXISTS:
            return self._refusal(found)
        waited = self.settings.publish_timeout.total_seconds()
        return RetryableError(f"{self.settings.where}: no acknowledgement within {waited:g}s (the broker answers)")

    def _noted(self, outcomes: list[Outcome]) -> list[Outcome]:
        """``outcomes``, told to the outage log: one line when the destination starts
        refusing everything (or its reason changes), one when a message goes again."""
        refused = [o for o in outcomes if isinstance(o, BrokerUnavailable)]
        if outcomes and len(refused) == len(outcomes):
            text = str(refused[0])
            # The same outage however its details vary from batch to batch: its kind
            # ("unreachable", "missing", ...), the words between the destination and a colon.
            self._outage.refused(text, key=text.removeprefix(self.settings.where).split(":", 1)[0])
        elif any(o is None for o in outcomes):
            self._outage.delivered()
        return outcomes

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        producer = self._producer
        if producer is None:
            return [DestinationCheck(self.settings.where, DestinationState.UNREACHABLE, "no producer connected")]
        found = await self._look(producer, CHECK_TIMEOUT_S)
        if found.state is DestinationState.EXISTS:
            self._verified = True
        return [DestinationCheck(self.settings.where, found.state, found.reason)]


def found_reason(found: TopicLook | None) -> str:
    return found.reason if found is not None else "no answer before the publish deadline"
