"""The NATS JetStream publisher: one JetStream publish per message, each acknowledged by
the stream before it counts as delivered, with ``Nats-Msg-Id`` = the event id."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors

from relay.adapters.header_text import header_value
from relay.adapters.nats.settings import NatsSettings
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome, each_message
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, PermanentError, RetryableError, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.adapters.nats")

CONNECT_TIMEOUT_S = 2.0
CONNECT_ATTEMPTS = 3
# Publishes buffered while the client reconnects: none. A publish during an outage fails at
# once (and is held), instead of waiting in the client for a server that may not come.
PENDING_SIZE = 0


class NatsPublisher:
    name = "nats"

    def __init__(self, settings: NatsSettings) -> None:
        self.settings = settings
        self._nc: Any = None
        self._js: Any = None
        self._where = settings.where

    async def _on_error(self, exc: Exception) -> None:
        # nats-py reports every failed reconnect here; the relay says an outage once.
        log.debug("NATS client: %s", mask(first_line(exc)))

    async def start(self) -> None:
        """Connect (a few tries, then ``ConfigError``). A missing stream is not an error
        here: it may be created after the relay starts; its messages wait meanwhile."""
        s = self.settings
        extra: dict[str, Any] = {}
        if s.creds_file:
            extra["user_credentials"] = s.creds_file
        if s.ca_file or any(server.startswith("tls://") for server in s.servers):
            extra["tls"] = ssl.create_default_context(cafile=s.ca_file)
        try:
            self._nc = await nats.connect(
                servers=list(s.servers),
                connect_timeout=CONNECT_TIMEOUT_S,
                max_reconnect_attempts=CONNECT_ATTEMPTS,
                allow_reconnect=True,
                error_cb=self._on_error,
                **extra,
            )
        except (nats.errors.NoServersError, OSError, TimeoutError) as exc:
            raise ConfigError(
                f"cannot reach NATS at {','.join(map(mask, s.servers))}: {mask(first_line(exc))}"
            ) from None
        # From here on, reconnect for as long as it takes: an outage holds messages.
        self._nc.options["max_reconnect_attempts"] = -1
        self._js = self._nc.jetstream()
        log.info("connected to NATS at %s", self._where)

    async def close(self) -> None:
        if self._nc is not None:
            # Drain: what was published is flushed first. A connection already closed
            # (the server went away for good) has nothing left to flush.
            with contextlib.suppress(nats.errors.ConnectionClosedError):
                await self._nc.drain()
            self._nc = None

    def headers(self, m: OutboxMessage) -> dict[str, str]:
        headers = {name: header_value(value) for name, value in m.envelope().items()}
        # The stream drops a message whose id it has seen within its duplicate_window: the
        # event id, and for a replay the run id beside it, so that a replay inside the
        # window is not dropped as the delivery it repeats (as SQS FIFO's dedup id).
        headers["Nats-Msg-Id"] = m.dedup_id
        return headers

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        if self._js is None:
            return [BrokerUnavailable("the NATS publisher is not started")] * len(batch)
        # The core leases at most one ordered message per aggregate into a batch, so the
        # whole batch may go at once.
        return await each_message(batch, self._send)

    async def _send(self, m: OutboxMessage) -> Outcome:
        try:
            subject = self.settings.subject.render(m)
        except ValueError as exc:
            return PermanentError(str(exc))
        timeout = self.settings.request_timeout.total_seconds()
        try:
            await self._js.publish(subject, m.body, timeout=timeout, headers=self.headers(m))
        except nats.errors.MaxPayloadError:
            return PermanentError(f"{len(m.body):,} bytes: more than the NATS server's max_payload")
        except nats.js.errors.NoStreamResponseError:
            return BrokerUnavailable(f"no JetStream stream captures subject {subject!r} ({self._where})")
        except nats.errors.TimeoutError:
            return RetryableError(f"no acknowledgement for subject {subject!r} within {timeout:g}s")
        except (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.StaleConnectionError,
            nats.errors.NoServersError,
            nats.errors.OutboundBufferLimitError,
        ) as exc:
            return BrokerUnavailable(f"NATS at {self._where}: {type(exc).__name__}")
        except nats.js.errors.BadRequestError as exc:
            # 400: the stream refuses this message as it is (headers over 64 KiB, a
            # message over the stream's max_msg_size): no retry changes that.
            return PermanentError(f"JetStream refused the message on subject {subject!r}: {mask(first_line(exc))}")
        except nats.js.errors.APIError as exc:
            return RetryableError(f"JetStream refused subject {subject!r}: {mask(first_line(exc))}")
        except nats.errors.Error as exc:
            return RetryableError(f"NATS: {type(exc).__name__}: {mask(first_line(exc))}")
        # A duplicate acknowledgement (the stream had this Nats-Msg-Id) is a delivery too.
        return None

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        template = self.settings.subject
        if not template.static:
            reason = "a subject template: each message's subject is looked up when it is published"
            return [DestinationCheck(self._where, DestinationState.EXISTS, reason)]
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                stream = await self._js.find_stream_name_by_subject(template.text)
        except nats.js.errors.NotFoundError:
            return [DestinationCheck(self._where, DestinationState.MISSING, "no JetStream stream captures it")]
        except (TimeoutError, nats.errors.Error) as exc:
            return [DestinationCheck(self._where, DestinationState.UNREACHABLE, mask(first_line(exc)))]
        return [DestinationCheck(self._where, DestinationState.EXISTS, f"stream {stream}")]
