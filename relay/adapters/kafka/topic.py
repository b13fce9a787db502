"""Looking at the topic: whether it exists (with a metadata request that may not create
it), and whether its partition count is still the one the relay first saw."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from aiokafka.client import AIOKafkaClient, ConnectionGroup
from aiokafka.protocol.metadata import MetadataRequest

from relay.adapters.kafka.classify import said
from relay.contract import DestinationState

log = logging.getLogger("relay.adapters.kafka")

# Kafka's error codes in a metadata answer that say something about the topic itself.
UNKNOWN_TOPIC = 3
TOPIC_AUTHORIZATION_FAILED = 29


@dataclass(frozen=True)
class TopicLook:
    """What one metadata request found: the topic's state, why (one line), and its
    partition count when it exists."""

    state: DestinationState
    reason: str = ""
    partitions: int | None = None


async def look(client: AIOKafkaClient, topic: str, timeout_s: float) -> TopicLook:
    """Ask the brokers ``client`` knows about ``topic``, one after another until one
    answers, within ``timeout_s``: a metadata request that may not create it.

    It goes on a connection of its own (aiokafka's coordination group, which an idempotent
    producer without transactions never uses): a broker answers one request per connection
    at a time, and on the producer's connection the look would queue behind a produce
    request the broker holds; asking whether the broker answers at all is the point."""
    nodes = [b.nodeId for b in client.cluster.brokers()]
    if not nodes:
        return TopicLook(DestinationState.UNREACHABLE, "no broker known")
    random.shuffle(nodes)
    request = MetadataRequest([topic], allow_auto_topic_creation=False)
    last = "no answer"
    try:
        async with asyncio.timeout(max(timeout_s, 0.0)):
            for node in nodes:
                try:
                    response = await client.send(node, request, group=ConnectionGroup.COORDINATION)
                except Exception as exc:  # a refused connection, a broker going away
                    last = said(exc)
                    continue
                return _found(response)
    except TimeoutError:
        return TopicLook(DestinationState.UNREACHABLE, f"no metadata answer within {timeout_s:.1f}s")
    return TopicLook(DestinationState.UNREACHABLE, f"no broker answers metadata ({last})")


def _found(response: object) -> TopicLook:
    topics = getattr(response, "topics", None) or []
    if not topics:
        return TopicLook(DestinationState.MISSING, "no such topic (the relay never creates topics)")
    # (error_code, topic, [is_internal,] partitions): the partitions are last at every version.
    code, partitions = topics[0][0], topics[0][-1]
    if code == 0:
        return TopicLook(DestinationState.EXISTS, "a metadata request found it", len(partitions))
    if code == UNKNOWN_TOPIC:
        return TopicLook(DestinationState.MISSING, "no such topic (the relay never creates topics)")
    if code == TOPIC_AUTHORIZATION_FAILED:
        return TopicLook(DestinationState.DENIED, "not authorized for this topic")
    return TopicLook(DestinationState.UNREACHABLE, f"metadata error code {code}")


class PartitionWatch:
    """The topic's partition count against the one the relay first saw. A change moves
    keys: the default partitioner takes the key's hash modulo the count, so an aggregate's
    records after it go to another partition than those before it, and a consumer of one
    partition no longer sees all of an aggregate's records in order. Nothing is held for
    it (the relay cannot undo it); it is logged, once per count seen."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.first: int | None = None
        self._warned: set[int] = set()

    def saw(self, partitions: int | None) -> None:
        if not partitions:
            return
        if self.first is None:
            self.first = partitions
            return
        if partitions != self.first and partitions not in self._warned:
            self._warned.add(partitions)
            log.warning(
                "%s has %d partitions, the relay first saw %d: keys now map to other partitions, so an"
                " aggregate's records from now on may be in another partition than its earlier ones"
                " (a consumer reading one partition no longer sees them all in order)",
                self.where,
                partitions,
                self.first,
            )
