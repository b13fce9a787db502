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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from relay.adapters.kafka.settings import OPTIONS, KafkaSettings
from relay.contract import PublishLimits

if TYPE_CHECKING:
    from relay.adapters.kafka.publisher import KafkaPublisher

__all__ = ["OPTIONS", "KafkaSettings", "create"]


def create(values: Mapping[str, Any], limits: PublishLimits) -> KafkaPublisher:
    """Build the publisher from resolved option values and the core's limits;
    ``relay.ConfigError`` on bad settings."""
    settings = KafkaSettings.from_values(values, limits)
    from relay.adapters.kafka.publisher import KafkaPublisher

    return KafkaPublisher(settings)
