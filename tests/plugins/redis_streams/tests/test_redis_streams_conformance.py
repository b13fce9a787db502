"""The Redis Streams destination passes the publisher conformance suite, built as the
relay builds it: found through its entry point (relay.testing.destination_spec), its
publisher made by its spec from option values, on the machine's Redis
(RELAY_TEST_REDIS_URL, default redis://127.0.0.1:6379/0), in streams of the test's own."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from datetime import timedelta

import pytest
import pytest_asyncio
import redis.asyncio

from relay import Publisher, PublishLimits
from relay.message import OutboxMessage
from relay.testing import destination_spec
from relay.testing.conformance import ARRIVAL_TIMEOUT_S, Delivered, Harness, PublisherConformance

REDIS_URL = os.environ.get("RELAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
LIMITS = PublishLimits(publish_timeout=timedelta(seconds=10), workers=4, batch_size=50)
# Envelope fields the relay sends as integers; a stream entry holds text.
NUMBERS = frozenset({"outbox_id", "attempt", "lease_version", "aggregate_seq"})


class RedisStreamsHarness(Harness):
    """A stream of the test's own (made with a consumer group, as a deployment makes one),
    read back from its start; the missing destination is a stream nobody made."""

    REFUSALS = ("over --redis-max-message-size",)
    MAX_MESSAGE_SIZE = 16 * 1024

    def __init__(self, client: redis.asyncio.Redis) -> None:
        super().__init__("redis-streams")
        self._client = client
        self.stream = f"relay-test-{uuid.uuid4().hex[:12]}"
        self._missing = f"relay-test-missing-{uuid.uuid4().hex[:12]}"
        self._stream_made = False
        self._last = "0-0"

    async def _on(self, stream: str) -> Publisher:
        values = {"redis_url": REDIS_URL, "stream": stream, "redis_max_message_size": self.MAX_MESSAGE_SIZE}
        publisher = destination_spec("redis-streams").create(values, LIMITS)
        await publisher.start()
        return publisher

    async def start_publisher(self) -> Publisher:
        if not self._stream_made:
            await self._client.xgroup_create(self.stream, "readers", id="$", mkstream=True)
            self._stream_made = True
        return await self._on(self.stream)

    async def start_missing_destination(self) -> Publisher:
        return await self._on(self._missing)

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        return replace(message, body=json.dumps({"blob": "x" * (self.MAX_MESSAGE_SIZE + 1)}).encode())

    async def read_delivered(self, expected: int) -> list[Delivered]:
        deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        while len(entries) < expected and time.monotonic() < deadline:
            entries += await self._client.xrange(self.stream, min=f"({self._last}")
            self._last = entries[-1][0].decode() if entries else self._last
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # a moment longer, so that a duplicate shows
        entries += await self._client.xrange(self.stream, min=f"({self._last}")
        self._last = entries[-1][0].decode() if entries else self._last
        return [self._delivered(fields) for _, fields in entries]

    @staticmethod
    def _delivered(fields: Mapping[bytes, bytes]) -> Delivered:
        envelope: dict[str, str | int] = {}
        for name, value in fields.items():
            key = name.decode()
            if key != "payload":
                envelope[key] = int(value) if key in NUMBERS else value.decode()
        return Delivered(envelope, fields[b"payload"])

    async def cleanup(self) -> None:
        await super().cleanup()
        await self._client.delete(self.stream, self._missing)


@pytest_asyncio.fixture
async def redis_client() -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(REDIS_URL)
    try:
        await client.ping()
    except (redis.ConnectionError, OSError):
        await client.aclose()
        if os.environ.get("RELAY_TEST_REQUIRE_SERVICES") == "1":
            pytest.fail(f"no Redis at {REDIS_URL}")
        pytest.skip(f"no Redis at {REDIS_URL} (set RELAY_TEST_REDIS_URL)")
    yield client
    await client.aclose()


class TestRedisStreams(PublisherConformance):
    @pytest.fixture
    def harness(self, redis_client: redis.asyncio.Redis, monkeypatch: pytest.MonkeyPatch) -> Harness:
        # This project's suite looks for no installed destination (tests/conftest.py): this
        # one is looked for here, through its entry point, as `relay start` would.
        monkeypatch.delenv("OUTBOX_RELAY_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        return RedisStreamsHarness(redis_client)
