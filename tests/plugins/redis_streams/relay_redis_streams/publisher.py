"""The publisher: one XADD per message, on redis-py's asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import redis.asyncio
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT, FieldT

from relay import (
    BrokerUnavailable,
    ConfigError,
    DestinationCheck,
    DestinationState,
    OutboxMessage,
    Outcome,
    PermanentError,
    RetryableError,
    each_message,
)
from relay_redis_streams.settings import RedisStreamsSettings

# The payload's field in each entry, after the envelope's.
PAYLOAD = "payload"
# How long a destination check may take, as the relay's own checks (relay.contract).
CHECK_TIMEOUT_S = 5.0


class RedisStreamsPublisher:
    """Adds each message to the stream as one entry: the envelope's fields (integers as
    their digits), then the payload. ``NOMKSTREAM``: a stream that does not exist is not
    made, its messages wait (BrokerUnavailable), as a missing queue's do."""

    name = "redis-streams"

    def __init__(self, settings: RedisStreamsSettings) -> None:
        self.settings = settings
        self._redis: redis.asyncio.Redis | None = None

    async def start(self) -> None:
        client = redis.asyncio.Redis.from_url(
            self.settings.url,
            socket_timeout=self.settings.command_timeout_s,
            socket_connect_timeout=self.settings.command_timeout_s,
        )
        try:
            await client.ping()
        except AuthenticationError as exc:
            await client.aclose()
            raise ConfigError(f"cannot connect to Redis for {self.settings.where}: {exc}") from None
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass  # not there yet: each publish says so (BrokerUnavailable) until it is
        self._redis = client

    async def close(self) -> None:
        client, self._redis = self._redis, None
        if client is not None:
            await client.aclose()

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        return await each_message(batch, self._send)

    async def _send(self, message: OutboxMessage) -> Outcome:
        assert self._redis is not None, "publish before start"
        envelope: dict[FieldT, EncodableT] = {name: str(value) for name, value in message.envelope().items()}
        if PAYLOAD in envelope:
            return PermanentError(f"a producer header named {PAYLOAD!r} has no room beside the payload's field")
        size = len(message.body) + sum(len(str(k).encode()) + len(str(v).encode()) for k, v in envelope.items())
        if size > self.settings.max_message_bytes:
            return PermanentError(f"{size} bytes, over --redis-max-message-size {self.settings.max_message_bytes}")
        try:
            entry = await self._redis.xadd(self.settings.stream, {**envelope, PAYLOAD: message.body}, nomkstream=True)
        except RedisTimeoutError as exc:  # sent, perhaps added: the attempt counts
            return RetryableError(f"no answer from Redis for {self.settings.where}: {exc}")
        except (RedisConnectionError, OSError) as exc:
            return BrokerUnavailable(f"Redis unreachable for {self.settings.where}: {exc}")
        except ResponseError as exc:  # WRONGTYPE (the key is no stream), OOM, ...: every message alike
            return BrokerUnavailable(f"Redis refused {self.settings.where}: {exc}")
        if entry is None:
            return BrokerUnavailable(f"{self.settings.where} does not exist: create it (XGROUP CREATE ... MKSTREAM)")
        return None

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        where = self.settings.where
        assert self._redis is not None, "check before start"
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                kind = await self._redis.type(self.settings.stream)
        except (TimeoutError, RedisTimeoutError, RedisConnectionError, OSError) as exc:
            return [DestinationCheck(where, DestinationState.UNREACHABLE, str(exc) or "no answer")]
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind == "stream":
            return [DestinationCheck(where, DestinationState.EXISTS)]
        if kind == "none":
            return [DestinationCheck(where, DestinationState.MISSING, "no such key (XGROUP ... MKSTREAM makes it)")]
        return [DestinationCheck(where, DestinationState.MISSING, f"the key holds a {kind}, not a stream")]
