"""The ``kafka`` destination: each outbox message is one record of a Kafka topic.

``relay start --broker kafka --bootstrap-servers HOST:PORT --topic TOPIC`` (or
``RELAY_BOOTSTRAP_SERVERS`` and ``RELAY_TOPIC``, or the ``[kafka]`` table; routes take
``topic = "..."``). The producer is aiokafka's (it runs in the relay's own event loop),
idempotent with ``acks=all``. The record's key is the aggregate id, so one aggregate's
records go to one partition (aiokafka's default partitioner: murmur2 of the key, modulo
the partition count, as the Java client's), in order; its value is the payload as stored;
its headers are the relay's fields and the producer's headers, values as UTF-8 text.

How failures are sorted: :mod:`relay.adapters.kafka.classify`. aiokafka is imported only
when this destination is used; this module and its options load without it.
"""

from __future__ import annotations

from relay.adapters.kafka.settings import OPTIONS, KafkaSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "KafkaSettings"]

SPEC = DestinationSpec(
    name="kafka",
    settings=KafkaSettings,
    publisher="relay.adapters.kafka.publisher:KafkaPublisher",
    options=OPTIONS,
    sdk_modules=("aiokafka", "async_timeout"),
    extra="outbox-relay[kafka]",
)
