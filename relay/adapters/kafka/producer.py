"""aiokafka's producer as the relay needs it: one that cannot create topics, and a way to
drop one without sending what it still holds.

Both reach past aiokafka's public API (tested with aiokafka 0.14.0), each in one place here:

- aiokafka has no option to turn topic auto-creation off. Its client refreshes metadata
  in ``AIOKafkaClient._metadata_update`` with ``MetadataRequest(topics)``, which at
  version 4 and later says ``allow_auto_topic_creation=true`` (and below 4 the broker
  creates a topic any metadata request names). A broker with ``auto.create.topics.enable``
  (Kafka's default, and noida-db's) then creates a topic that was deleted, with the
  broker's default partition count, the first time the producer refreshes after a send to
  it: keys land on other partitions, and the docs say the relay never creates topics.
  :class:`NoAutoCreateClient` is that method with the flag false; the producer's client is
  made one by :func:`make_producer`.
- ``AIOKafkaProducer.stop()`` delivers everything queued first, and an idempotent producer
  never gives a record up (it retries until the broker takes it). When the relay hands a
  message back (held for an outage, or its producer replaced), a record of it still
  queued must not be delivered later by the old producer: the relay sends it again, and
  the topic would hold it twice. :func:`discard` stops the producer's sender first and
  fails what it held.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient, ConnectionGroup
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError
from aiokafka.protocol.metadata import MetadataRequest

log = logging.getLogger("relay.adapters.kafka")

# How long dropping a producer may take: its sender first finishes the produce requests it
# has on the wire, each bounded by the request timeout (at most 0.8 of --publish-timeout).
DISCARD_TIMEOUT_S = 30.0


class NoAutoCreateClient(AIOKafkaClient):  # type: ignore[misc]  # aiokafka is untyped
    """aiokafka's client whose metadata requests never create a topic: its own
    ``_metadata_update`` (aiokafka 0.14.0), the one change marked."""

    async def _metadata_update(self, cluster_metadata: ClusterMetadata, topics: Any) -> bool:
        # The one change: allow_auto_topic_creation=False (aiokafka leaves it true).
        metadata_request = MetadataRequest(list(topics) if topics else None, allow_auto_topic_creation=False)
        nodeids = [b.nodeId for b in self.cluster.brokers()]
        bootstrap_id = ("bootstrap", ConnectionGroup.DEFAULT)
        if bootstrap_id in self._conns:
            nodeids.append("bootstrap")
        random.shuffle(nodeids)
        for node_id in nodeids:
            conn = await self._get_conn(node_id)
            if conn is None:
                continue
            try:
                metadata = await conn.send(metadata_request)
            except (KafkaError, TimeoutError) as err:
                log.debug("no metadata from Kafka node %s: %r", node_id, err)
                continue
            # No brokers: the cluster is not ready (aiokafka keeps what it had).
            if not metadata.brokers:
                return False
            cluster_metadata.update_metadata(metadata)
            if bootstrap_id in self._conns and len(self.cluster.brokers()):
                self._conns.pop(bootstrap_id).close()
            return True
        cluster_metadata.failed_update(None)
        return False


def make_producer(**options: Any) -> AIOKafkaProducer:
    """``AIOKafkaProducer(**options)`` whose client is a :class:`NoAutoCreateClient`.

    The producer builds its client itself, and hands that object to its accumulator and
    sender: the class of that one object is changed (the subclass adds no state, only the
    method), so every reference to it sees the change."""
    producer = AIOKafkaProducer(**options)
    producer.client.__class__ = NoAutoCreateClient
    return producer


class Discarded(Exception):
    """What a record still queued in a discarded producer fails with: it was never
    acknowledged, and the relay holds its message."""


async def discard(producer: AIOKafkaProducer, why: str) -> None:
    """Stop ``producer`` without delivering what it still holds: its sender stops (the
    requests already on the wire finish or fail, within the request timeout), every
    record still queued fails with :class:`Discarded`, then the producer closes."""
    sender = producer._sender
    task = sender.sender_task
    if task is not None and not task.done():
        task.cancel()
        # aiokafka's sender catches its cancellation and waits for its requests on the
        # wire; asyncio.wait does not raise what it ends with, only our own cancellation.
        await asyncio.wait([task])
    _fail_queued(producer, Discarded(why))
    # With the sender done, stop() delivers nothing more: it only closes the connections.
    # (A stop() cut short earlier left it marked closed: close the client in any case.)
    await producer.stop()
    await producer.client.close()


def _fail_queued(producer: AIOKafkaProducer, error: Exception) -> None:
    """aiokafka's own ``MessageAccumulator.fail_all(error)``, without the two things it
    leaves for the event loop to complain about."""
    accumulator = producer._message_accumulator
    queued = [batch for batches in accumulator._batches.values() for batch in batches]
    for batch in queued:
        # A batch drained once and put back for a retry has a callback (registered on its
        # first drain) that removes it from the pending set when it ends: fail_all leaves
        # it out of that set, and the callback's KeyError would be logged with a traceback.
        if batch.retry_count:
            accumulator._pending_batches.add(batch)
    accumulator.fail_all(error)
    for batch in queued:
        # fail_all sets the error on the waiter for the batch's next drain, which nobody
        # awaits now: read, or asyncio logs "exception was never retrieved" for each.
        waiter = batch._drain_waiter
        if waiter.done() and not waiter.cancelled():
            waiter.exception()


def forget(future: asyncio.Future[Any]) -> None:
    """Nobody will await ``future`` (a record whose message the relay handed back): read
    its outcome when it ends, so that asyncio does not log it as never retrieved."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
