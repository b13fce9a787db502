"""The HTTP publisher: one request per message, over one aiohttp session per destination
(a pooled, keep-alive connector of ``--http-concurrency`` connections)."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import ssl
import time
from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlsplit

import aiohttp

from relay.adapters.header_text import header_value
from relay.adapters.http.classify import BODY_SHOWN_BYTES, classify_status
from relay.adapters.http.deferrals import Deferrals
from relay.adapters.http.redirects import MAX_REDIRECTS, Redirect, next_hop, too_many
from relay.adapters.http.settings import PRODUCER_REFUSED_HEADERS, RESERVED_HEADERS, HttpSettings
from relay.adapters.http.signing import signature
from relay.cloudevents import JSON, STRUCTURED_CONTENT_TYPE, binary_headers, body_for
from relay.contract import CHECK_TIMEOUT_S, DestinationCheck, DestinationState, Outcome, each_message, publish_deadline
from relay.dsn import mask
from relay.errors import BrokerUnavailable, ConfigError, NotSent, PermanentError, RetryableError, first_line
from relay.message import OutboxMessage

log = logging.getLogger("relay.adapters.http")

# The relay's fields as request headers: "Relay-" and the field's name in words.
FIELD_HEADERS = {
    "outbox_id": "Relay-Outbox-Id",
    "event_id": "Relay-Event-Id",
    "aggregate_type": "Relay-Aggregate-Type",
    "aggregate_id": "Relay-Aggregate-Id",
    "event_type": "Relay-Event-Type",
    "attempt": "Relay-Attempt",
    "lease_version": "Relay-Lease-Version",
    "aggregate_seq": "Relay-Aggregate-Seq",
    "aggregate_epoch": "Relay-Aggregate-Epoch",
    "replay": "Relay-Replay",
}
# An answer bigger than this is not read to its end: its connection is closed instead.
_DRAIN_MAX_BYTES = 1 << 20
# How long an answer's body is read once its status line is in: long enough for any
# ordinary answer on a live connection (so the connection goes back to the pool), short
# enough that a body dripping for minutes costs one closed connection, never the outcome
# the status already gave.
BODY_READ_S = 1.0
# The body read also ends this long before the publish deadline, so that the outcome is
# handed back before the relay cuts the whole publish (which would undo a 2xx).
BODY_READ_DEADLINE_MARGIN_S = 0.1
# How soon a message held back by the concurrency limit is claimed again (one held back by
# the rate waits for the next free turn, at least this).
NOT_SENT_DELAY_S = 0.2
# aiohttp's own deadlines off: the relay's (the request's until its status line, the body
# read's after it) are asyncio timeouts around each phase. aiohttp's ``total`` would run
# on through the body read and turn a delivered 2xx into a timeout.
_NO_AIOHTTP_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None)
# An http(s) URL's query in someone else's error text (aiohttp quotes request URLs).
_URL_QUERY = re.compile(r"(https?://[^\s?#'\"]*)\?[^\s#'\"]*")


async def _drain(response: aiohttp.ClientResponse, until: float) -> tuple[bytes, bool]:
    """The first bytes of ``response``'s body (what :func:`classify_status` may show),
    the rest read and dropped up to ``_DRAIN_MAX_BYTES`` or the loop's time ``until``;
    whether the body was read to its end. Errors end the read and are ignored: the status
    line already said what the answer is."""
    content = response.content
    if content.is_eof():
        # The whole (short) body came in with the status line, as most answers do: no
        # read to wait for, and no timer to set for it.
        try:
            whole = content.read_nowait()
        except Exception:  # the body's own error: the status line already said it all
            return b"", False
        return whole[: BODY_SHOWN_BYTES + 1], True
    kept = b""
    total = 0
    try:
        async with asyncio.timeout_at(until):
            while total <= _DRAIN_MAX_BYTES:
                chunk = await response.content.readany()
                if not chunk:
                    return kept, True
                if len(kept) < BODY_SHOWN_BYTES + 1:
                    kept += chunk[: BODY_SHOWN_BYTES + 1 - len(kept)]
                total += len(chunk)
    except Exception:  # a timeout, a reset, a malformed chunk or encoding: all the same here
        pass
    return kept, False


def _without_queries(text: str) -> str:
    """``text`` with the query of every http(s) URL in it dropped: a query value too short
    to be masked literally must not be shown at all."""
    return _URL_QUERY.sub(r"\1", text) if "?" in text else text


def _said(exc: BaseException) -> str:
    """Someone else's error, for a line: type, first line, no URL query, masked."""
    return f"{type(exc).__name__}: {mask(_without_queries(first_line(exc)[:500]))}"


class RateLimit:
    """At most ``rate`` starts a second, spaced evenly (no bursts: an API's quota counts
    per second or finer); ``rate`` 0 is no limit."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = 0.0

    async def wait(self, latest: float | None = None) -> bool:
        """Wait for this request's turn; False at once, reserving nothing, when it would
        have to wait past ``latest`` (the loop's time)."""
        if not self.interval:
            return True
        now = asyncio.get_running_loop().time()
        slot = max(now, self._next)
        if slot > now and latest is not None and slot > latest:
            return False
        self._next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)
        return True

    def next_turn_in(self) -> float:
        """Seconds until the next free turn (0: one is free now)."""
        return max(0.0, self._next - asyncio.get_running_loop().time()) if self.interval else 0.0


class HttpPublisher:
    name = "http"

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._ssl: ssl.SSLContext | None = None
        self._slots = asyncio.Semaphore(settings.concurrency)
        self._rate = RateLimit(settings.rate)
        self._where = settings.where
        self._deferrals = Deferrals(settings.retry_after_max)
        # Names the destination's static headers take: a producer header of the same name
        # in another case would be sent beside it, not instead of it.
        self._static = frozenset(name.lower() for name in settings.headers)

    def _ssl_context(self) -> ssl.SSLContext:
        s = self.settings
        try:
            context = ssl.create_default_context(cafile=s.ca_file)
            if s.client_cert:
                context.load_cert_chain(s.client_cert, s.client_key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"TLS settings for {s.where}: {first_line(exc)}") from None
        return context

    async def start(self) -> None:
        self._ssl = self._ssl_context()
        connector = aiohttp.TCPConnector(limit=self.settings.concurrency, ssl=self._ssl, keepalive_timeout=30)
        # Our own Content-Type on every request; no cookies kept between messages.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=_NO_AIOHTTP_TIMEOUT, cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=True
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def body(self, m: OutboxMessage) -> bytes:
        """What a request carries: the payload, or (``--envelope cloudevents-json``) the
        structured CloudEvent around it."""
        return body_for(m, self.settings.cloudevents)

    def headers(self, m: OutboxMessage, now: int, body: bytes | None = None) -> dict[str, str]:
        """A request's headers: the producer's (trace context among them; never credentials,
        PRODUCER_REFUSED_HEADERS), the destination's static ones, then the relay's, which
        nothing else may stand in for: its Relay-* headers, or with ``--envelope cloudevents``
        the CloudEvents HTTP binding's ce-* headers (binary mode) or content type
        (structured). ``body``: what the request carries (signed), the payload by default."""
        ce = self.settings.cloudevents
        headers: dict[str, str] = {}
        for name, text in (m.headers or {}).items():
            lower = name.lower()
            refused = lower in RESERVED_HEADERS or lower in PRODUCER_REFUSED_HEADERS or lower.startswith("relay-")
            if ce is not None:
                refused = refused or lower.startswith("ce-")
            if not refused and lower not in self._static:
                headers[name] = header_value(text)
        headers.update(self.settings.headers)
        event_id = m.event_id or str(m.id)
        headers["Idempotency-Key"] = event_id
        if ce is None:
            headers["Content-Type"] = "application/json"
            for field, value in m.envelope().items():
                if field in FIELD_HEADERS:
                    headers[FIELD_HEADERS[field]] = header_value(value)
        elif ce.structured:
            headers["Content-Type"] = STRUCTURED_CONTENT_TYPE
        else:
            headers["Content-Type"] = JSON
            for name, value in binary_headers(m, ce.source, "ce-").items():
                if name.startswith("ce-"):  # the producer's own headers were taken above
                    headers[name] = header_value(value)
        if self.settings.secrets:
            headers["webhook-id"] = event_id
            headers["webhook-timestamp"] = str(now)
            headers["webhook-signature"] = signature(
                self.settings.secrets, event_id, now, m.body if body is None else body
            )
        return headers

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        # The core leases at most one ordered message per aggregate into a batch, so the
        # whole batch may go at once; the semaphore bounds it per destination, and a batch
        # needs no more lanes than the destination has connections.
        # The lanes take the messages in order: the first of each goes at once, the rest
        # wait for their lane's previous request.
        lanes = self.settings.concurrency
        waiting = {id(m) for m in batch[lanes:]}
        return await each_message(batch, lambda m: self._send(m, waited=id(m) in waiting), at_once=lanes)

    async def _send(self, m: OutboxMessage, *, waited: bool = False) -> Outcome:
        """One message's request and its outcome; whatever happens while sending it or
        reading its answer is this outcome, never an exception."""
        return self._deferrals.paced(m, await self._send_within_limits(m, waited=waited))

    async def _send_within_limits(self, m: OutboxMessage, *, waited: bool) -> Outcome:
        session = self._session
        if session is None:
            return BrokerUnavailable("the HTTP publisher is not started")
        s = self.settings
        # A request that must wait for a connection slot or a rate turn waits only while it
        # could still be answered within its own timeout before the publish deadline; past
        # that it is handed back unsent (NotSent: attempt refunded), instead of being cut by
        # the deadline and charged an attempt it never used. One that need not wait goes.
        deadline = publish_deadline()
        latest = None if deadline is None else deadline - s.timeout.total_seconds()
        if waited and latest is not None and asyncio.get_running_loop().time() > latest:
            # It waited in its lane (each_message) past the moment it could be answered.
            return self._not_sent("every --http-concurrency connection stayed busy too long")
        try:
            async with asyncio.timeout_at(latest if self._slots.locked() else None):
                await self._slots.acquire()
        except TimeoutError:
            return self._not_sent("every --http-concurrency connection stayed busy too long")
        try:
            if not await self._rate.wait(latest):
                return self._not_sent("--http-rate gave no turn early enough")
            try:
                body = self.body(m)
                headers = self.headers(m, int(time.time()), body)
            except Exception as exc:  # what this message's own fields make of a request
                return PermanentError(f"cannot make a request of this message for {self._where}: {_said(exc)}")
            return await self._request(session, body, headers)
        finally:
            self._slots.release()

    async def _request(self, session: aiohttp.ClientSession, body: bytes, headers: dict[str, str]) -> Outcome:
        """The request, and the redirects it may follow (:mod:`relay.adapters.http.redirects`), until a status
        line that is no followed redirect, within ``--http-timeout``; that answer's outcome."""
        s = self.settings
        loop = asyncio.get_running_loop()
        until = loop.time() + s.timeout.total_seconds()
        url = s.url
        try:
            for _hop in range(MAX_REDIRECTS + 1):
                async with asyncio.timeout_at(until):
                    response = await session.request(
                        s.method, url, data=body, headers=headers, allow_redirects=False, timeout=_NO_AIOHTTP_TIMEOUT
                    )
                # Read to its end (within its own bound), so that the connection goes back
                # to the pool for the next request, but keep no more of it than an error
                # line shows; a body not read to its end closes its connection instead.
                complete = False
                try:
                    hop = self._next_hop(response, url)
                    answer, complete = await _drain(response, self._body_read_until())
                    if hop is None:
                        return self._outcome(response, answer, url)
                    if isinstance(hop, BaseException):
                        return hop
                    url = hop.url
                finally:
                    if complete:
                        response.release()
                    else:
                        response.close()
            return too_many(url, where=self._where)
        except aiohttp.ClientConnectorError as exc:
            # Refused, no such host, TLS handshake or certificate: nothing was sent.
            return BrokerUnavailable(f"{self._where} unreachable: {_said(exc)}")
        except (TimeoutError, aiohttp.ServerTimeoutError):
            return RetryableError(f"{self._where} did not answer within {s.timeout.total_seconds():g}s")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if await self._refuses_tls_client():
                return BrokerUnavailable(
                    f"{self._where} closes every connection right after the TLS handshake: it wants a client"
                    " certificate (--http-client-cert) or refuses the one sent"
                )
            return RetryableError(f"{self._where}: {_said(exc)}")
        except aiohttp.ClientError as exc:  # closed mid-answer, a malformed answer
            return RetryableError(f"{self._where}: {_said(exc)}")
        except Exception as exc:  # nothing foreseen: this message's outcome all the same
            log.warning("unexpected error sending to %s: %s", self._where, _said(exc))
            return RetryableError(f"{self._where}: the request failed unexpectedly: {_said(exc)}")

    def _next_hop(self, response: aiohttp.ClientResponse, url: str) -> Redirect | BaseException | None:
        """For a 3xx followed under --http-follow-redirects, where to (or why not); None
        for any other answer."""
        if not (self.settings.follow_redirects and 300 <= response.status < 400):
            return None
        return next_hop(response.status, response.headers, url, home=self.settings.url, where=self._where)

    def _outcome(self, response: aiohttp.ClientResponse, body: bytes, url: str) -> Outcome:
        """The outcome of a final answer: a 2xx is delivered, whatever its body did (its
        read is bounded on its own and its errors ignored)."""
        status = response.status
        if 200 <= status < 300:
            return None
        try:
            return classify_status(
                status, response.headers, body, where=self._where, cap=self.settings.retry_after_max, url=url
            )
        except Exception as exc:  # a header or body no rule foresaw: this message's outcome
            return RetryableError(f"{self._where} answered {status}, an answer that could not be read: {_said(exc)}")

    def _body_read_until(self) -> float:
        """When a body read ends, in the loop's time: BODY_READ_S from now, and before the
        publish deadline."""
        until = asyncio.get_running_loop().time() + BODY_READ_S
        deadline = publish_deadline()
        return until if deadline is None else min(until, deadline - BODY_READ_DEADLINE_MARGIN_S)

    def _not_sent(self, why: str) -> NotSent:
        wait = max(self._rate.next_turn_in(), NOT_SENT_DELAY_S)
        return NotSent(
            timedelta(seconds=wait),
            f"not sent to {self._where}: {why} for an answer within the publish timeout",
        )

    async def _refuses_tls_client(self) -> bool:
        """Whether an https destination ends a bare request's connection before answering
        a byte. Under TLS 1.3 a server checks the client's certificate after the handshake
        has completed for the client, and its refusal reaches the client as a closed or
        reset connection, which alone would read as a transient fault and spend attempts;
        a destination that answers this probe at all reset that one request only."""
        parts = urlsplit(self.settings.url)
        if parts.scheme != "https" or self._ssl is None:
            return False
        host = parts.hostname or ""
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(host, parts.port or 443, ssl=self._ssl)
                try:
                    writer.write(f"HEAD / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                    await writer.drain()
                    answered = await reader.read(1)
                finally:
                    writer.close()
        except TimeoutError:
            return False  # slow, not refusing
        except OSError:
            return True
        return not answered

    async def check_destinations(self) -> Sequence[DestinationCheck]:
        """A connection to the URL's host (with its TLS handshake for https): refused,
        unresolvable or untrusted is unreachable. Whether the URL takes events only a
        request tells, and a check sends none."""
        parts = urlsplit(self.settings.url)
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        where = f"HTTP destination {self.settings.where}"
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                _reader, writer = await asyncio.open_connection(
                    parts.hostname, port, ssl=(self._ssl or self._ssl_context()) if https else None
                )
                writer.close()
                await writer.wait_closed()
        except TimeoutError:
            return [DestinationCheck(where, DestinationState.UNREACHABLE, f"no connection within {CHECK_TIMEOUT_S:g}s")]
        except (ConnectionRefusedError, socket.gaierror) as exc:
            # Nothing listens there, or no such host: as missing as a queue nobody made.
            return [DestinationCheck(where, DestinationState.MISSING, mask(first_line(exc)))]
        except OSError as exc:  # a TLS handshake or certificate failure among them
            return [DestinationCheck(where, DestinationState.UNREACHABLE, mask(first_line(exc)))]
        return [DestinationCheck(where, DestinationState.EXISTS, "it accepts connections; a check sends no request")]
