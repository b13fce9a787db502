"""The ``redis-streams`` destination: each outbox message is one entry of a Redis stream.

Found by the relay through this package's entry point (``outbox_relay.destinations``):
``relay start --broker redis-streams --redis-url redis://HOST:6379/0 --stream STREAM``.
This module and its options load without redis-py, which only the publisher imports.
"""

from __future__ import annotations

from relay import DestinationSpec
from relay_redis_streams.settings import OPTIONS, RedisStreamsSettings

__all__ = ["SPEC", "RedisStreamsSettings"]

SPEC = DestinationSpec(
    name="redis-streams",
    settings=RedisStreamsSettings,
    publisher="relay_redis_streams.publisher:RedisStreamsPublisher",
    options=OPTIONS,
    sdk_modules=("redis",),
    extra="relay-redis-streams",
)
