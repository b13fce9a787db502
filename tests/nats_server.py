"""NATS with JetStream for the tests: the server this machine runs on 127.0.0.1:4222 (or
``RELAY_TEST_NATS_URL``), a stream of each test's own (unique name and subjects, deleted
afterwards), and reading a stream back from its first message.

``nats`` is a session fixture and ``nats_stream`` a test's stream, registered for every
module by ``pytest_plugins`` in tests/conftest.py. Without a server the tests skip, or
fail under ``RELAY_TEST_REQUIRE_SERVICES=1`` (bash .ci/run starts one).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import nats
import pytest
from nats.js.api import StreamConfig

from tests.services import require_services

SKIP_NATS = "no NATS with JetStream for the tests: set RELAY_TEST_NATS_URL=nats://host:4222 (bash .ci/run starts one)"


@dataclass(frozen=True)
class StreamMessage:
    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes


@dataclass
class NatsStream:
    url: str
    name: str
    prefix: str  # the stream captures prefix + ".>"
    duplicate_window_s: float = 120.0

    def subject(self, *tokens: str) -> str:
        return ".".join((self.prefix, *tokens))

    async def _js(self) -> tuple[Any, Any]:
        nc = await nats.connect(self.url)
        return nc, nc.jetstream()

    def create(self, max_msg_size: int = -1) -> None:
        async def run() -> None:
            nc, js = await self._js()
            try:
                await js.add_stream(
                    StreamConfig(
                        name=self.name, subjects=[self.prefix + ".>"], duplicate_window=self.duplicate_window_s,
                        max_msg_size=max_msg_size,
                    )
                )  # fmt: skip
            finally:
                await nc.close()

        asyncio.run(run())

    def delete(self) -> None:
        async def run() -> None:
            nc, js = await self._js()
            try:
                await js.delete_stream(self.name)
            except nats.js.errors.NotFoundError:
                pass
            finally:
                await nc.close()

        asyncio.run(run())

    def read(self) -> list[StreamMessage]:
        """Every message in the stream, in stream order (what a consumer of the stream reads)."""

        async def run() -> list[StreamMessage]:
            nc, js = await self._js()
            try:
                info = await js.stream_info(self.name)
                got: list[StreamMessage] = []
                for seq in range(info.state.first_seq, info.state.last_seq + 1):
                    if info.state.messages == 0:
                        break
                    raw = await js.get_msg(self.name, seq)
                    got.append(StreamMessage(raw.seq, raw.subject, dict(raw.headers or {}), raw.data or b""))
                return got
            finally:
                await nc.close()

        return asyncio.run(run())


def _answers(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def nats_url() -> str:
    url = os.environ.get("RELAY_TEST_NATS_URL", "nats://127.0.0.1:4222")
    if not _answers(url):
        if require_services():
            pytest.fail(SKIP_NATS)
        pytest.skip(SKIP_NATS)
    return url


@pytest.fixture
def nats_stream(nats_url: str) -> Iterator[NatsStream]:
    """A stream of this test's own, not yet created (``create()``), deleted afterwards."""
    token = uuid.uuid4().hex[:10]
    stream = NatsStream(nats_url, f"RELAY_TEST_{token}", f"relay-test.{token}")
    yield stream
    stream.delete()
