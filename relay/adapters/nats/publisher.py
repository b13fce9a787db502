"""The NATS JetStream publisher: one JetStream publish per message, each acknowledged by
the stream before it counts as delivered, with ``Nats-Msg-Id`` = the event id.

A batch goes out pipelined: every message is published with a reply subject of its own
under one subscription of the publisher's, then the acknowledgements are awaited together
(what ``JetStreamContext.publish`` does one message at a time, with a task, a future and
a timer each: 60% of the relay's CPU a message went there). Each message's outcome is
still its own acknowledgement's."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import ssl
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.api
import nats.js.errors

from relay.adapters.header_text import header_value
from relay.adapters.nats.settings import NatsSettings
from relay.cloudevents import JSON, STRUCTURED_CONTENT_TYPE, binary_headers, body_for, plain_headers
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, PermanentError, RetryableError, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.adapters.nats")

CONNECT_TIMEOUT_S = 2.0
CONNECT_ATTEMPTS = 3
# Publishes buffered while the client reconnects: none. A publish during an outage fails at
# once (and is held), instead of waiting in the client for a server that may not come.
PENDING_SIZE = 0
# The status a NATS server answers a request with when nothing subscribes to its subject:
# here, no JetStream stream captures it.
NO_RESPONDERS = "503"


# Publishing refused because the connection is not there (an outage holds the messages).
_UNAVAILABLE = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.NoServersError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionDrainingError,
)


class NatsPublisher:
    name = "nats"

    def __init__(self, settings: NatsSettings) -> None:
        self.settings = settings
        self._nc: Any = None
        self._js: Any = None
        self._where = settings.where
        # The acknowledgements awaited, by reply subject; the subscription they come on.
        self._acks: dict[str, asyncio.Future[Any]] = {}
        self._replies: Any = None
        self._inbox = ""
        self._tokens = itertools.count()

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
            self._replies = None
            # Drain: what was published is flushed first. A connection already closed
            # (the server went away for good) has nothing left to flush.
            with contextlib.suppress(nats.errors.ConnectionClosedError):
                await self._nc.drain()
            self._nc = None

    def body(self, m: OutboxMessage) -> bytes:
        """The payload, or (``--envelope cloudevents-json``) the structured CloudEvent."""
        return body_for(m, self.settings.cloudevents)

    def headers(self, m: OutboxMessage) -> dict[str, str]:
        """The relay's envelope as headers, or the CloudEvents attributes as ``ce-`` headers
        (binary mode, with ``content-type``), or only the content type (structured)."""
        ce = self.settings.cloudevents
        if ce is None:
            headers = {name: header_value(value) for name, value in m.envelope().items()}
        elif ce.structured:
            headers = {k: header_value(v) for k, v in plain_headers(m).items()}
            headers["content-type"] = STRUCTURED_CONTENT_TYPE
        else:
            headers = {name: header_value(value) for name, value in binary_headers(m, ce.source, "ce-").items()}
            headers["content-type"] = JSON
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
        try:
            await self._subscribe()
        except nats.errors.Error as exc:
            return [BrokerUnavailable(f"NATS at {self._where}: {type(exc).__name__}")] * len(batch)
        outcomes: list[Outcome] = [None] * len(batch)
        sent: dict[int, tuple[str, str, asyncio.Future[Any]]] = {}
        try:
            for i, m in enumerate(batch):
                try:
                    outcomes[i] = await self._send(m, i, sent)
                except Exception as exc:  # a message's own fault (its headers, say) is its own outcome
                    outcomes[i] = exc
            if sent:
                await asyncio.wait(
                    [f for _, _, f in sent.values()], timeout=self.settings.request_timeout.total_seconds()
                )
            for i, (subject, _, future) in sent.items():
                outcomes[i] = self._acknowledged(subject, future)
        finally:
            for _, reply, future in sent.values():
                self._acks.pop(reply, None)
                future.cancel()
        return outcomes

    async def _subscribe(self) -> None:
        """The subscription every acknowledgement comes on (once; the client renews it
        after a reconnect)."""
        if self._replies is None:
            self._inbox = self._nc.new_inbox()
            self._replies = await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Any) -> None:
        future = self._acks.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result(msg)

    async def _send(self, m: OutboxMessage, i: int, sent: dict[int, tuple[str, str, asyncio.Future[Any]]]) -> Outcome:
        """Publish ``m`` with a reply subject of its own; its acknowledgement is awaited
        with the batch's (``sent``). An outcome now if it could not be published."""
        try:
            subject = self.settings.subject.render(m)
        except ValueError as exc:
            return PermanentError(str(exc))
        reply = f"{self._inbox}.{next(self._tokens)}"
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._acks[reply] = future
        try:
            body = self.body(m)
            await self._nc.publish(subject, body, reply=reply, headers=self.headers(m))
        except BaseException as exc:
            self._acks.pop(reply, None)
            if isinstance(exc, nats.errors.MaxPayloadError):
                return PermanentError(f"{len(self.body(m)):,} bytes: more than the NATS server's max_payload")
            if isinstance(exc, _UNAVAILABLE):
                return BrokerUnavailable(f"NATS at {self._where}: {type(exc).__name__}")
            if isinstance(exc, nats.errors.Error):
                return RetryableError(f"NATS: {type(exc).__name__}: {mask(first_line(exc))}")
            raise
        sent[i] = (subject, reply, future)
        return None

    def _acknowledged(self, subject: str, future: asyncio.Future[Any]) -> Outcome:
        """The outcome of a message from its acknowledgement (or its absence)."""
        if not future.done():
            timeout = self.settings.request_timeout.total_seconds()
            return RetryableError(f"no acknowledgement for subject {subject!r} within {timeout:g}s")
        msg = future.result()
        if msg.headers and msg.headers.get(nats.js.api.Header.STATUS) == NO_RESPONDERS:
            return BrokerUnavailable(f"no JetStream stream captures subject {subject!r} ({self._where})")
        try:
            answer = json.loads(msg.data)
            error = answer.get("error") if isinstance(answer, dict) else None
            if error is None:
                # A duplicate acknowledgement (the stream had this Nats-Msg-Id) is a delivery too.
                return None
            nats.js.errors.APIError.from_error(error)  # raises the error's own class
        except nats.js.errors.BadRequestError as exc:
            # 400: the stream refuses this message as it is (headers over 64 KiB, a
            # message over the stream's max_msg_size): no retry changes that.
            return PermanentError(f"JetStream refused the message on subject {subject!r}: {mask(first_line(exc))}")
        except nats.js.errors.APIError as exc:
            return RetryableError(f"JetStream refused subject {subject!r}: {mask(first_line(exc))}")
        except (ValueError, TypeError, KeyError) as exc:  # not JetStream's answer
            return RetryableError(f"an acknowledgement for subject {subject!r} that is not JetStream's: {exc}")
        return RetryableError(f"JetStream refused subject {subject!r}")

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
