"""HTTP: what the relay's http destination sends, read and verified, and an aiohttp
handler that applies it (:meth:`relay.Consumer.webhook_handler`).

The relay sends each event as one POST: the payload as the body, the event id as
``Idempotency-Key`` (the same on every retry), its fields as ``Relay-<Field-Name>``
headers (``Relay-Aggregate-Seq``, ...), the producer's headers as they are, and with
signing secrets the Standard Webhooks headers ``webhook-id`` (the event id again),
``webhook-timestamp`` and ``webhook-signature`` (relay/adapters/http/signing.py).
The signature covers the id, the timestamp and the body, not the other headers: they
are trusted as far as the connection is (use TLS).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from relay.consumers.verdict import Applier, Verdict
from relay.inbox import _RELAY_FIELDS, Received, _received

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("relay.consumers.webhook")

_SECRET_PREFIX = "whsec_"
# How far a Standard Webhooks timestamp may be from this host's clock (the libraries'
# default): a captured request cannot be replayed later than this.
WEBHOOK_TOLERANCE = timedelta(minutes=5)
# Request headers that are the transport's or the relay's, not the producer's.
_NOT_PRODUCER = frozenset(
    {
        "host", "user-agent", "accept", "accept-encoding", "content-type", "content-length", "connection",
        "authorization", "idempotency-key", "webhook-id", "webhook-timestamp", "webhook-signature",
    }
)  # fmt: skip


class WebhookRejected(ValueError):
    """A request to refuse: ``status`` is the answer (401: its signature does not verify,
    or it carries none where secrets are set; 400: the relay did not send it)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _keys(secrets: str) -> list[bytes]:
    keys = []
    for number, secret in enumerate(secrets.split(), 1):
        encoded = secret.removeprefix(_SECRET_PREFIX)
        try:
            keys.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            raise ValueError(f"webhook secret {number} is not whsec_ followed by base64") from None
    if not keys:
        raise ValueError("no webhook secret given: pass None to accept unsigned requests")
    return keys


def _verify(headers: Mapping[str, str], body: bytes, keys: list[bytes], tolerance: timedelta, now: float) -> None:
    msg_id, stamp, signatures = (headers.get(h) for h in ("webhook-id", "webhook-timestamp", "webhook-signature"))
    if not (msg_id and stamp and signatures):
        raise WebhookRejected("no Standard Webhooks signature (webhook-id, -timestamp, -signature)", 401)
    if not stamp.isascii() or not stamp.isdigit():
        raise WebhookRejected("webhook-timestamp is not a number of seconds", 401)
    if abs(now - int(stamp)) > tolerance.total_seconds():
        raise WebhookRejected(f"webhook-timestamp {stamp} is further than {tolerance} from this host's clock", 401)
    signed = f"{msg_id}.{stamp}.".encode() + body
    expected = [base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()) for key in keys]
    for given in signatures.split():
        version, _, value = given.partition(",")
        if version == "v1" and any(hmac.compare_digest(value.encode(), e) for e in expected):
            return
    raise WebhookRejected("webhook-signature does not verify with any of the secrets", 401)


def received_from_webhook(
    headers: Mapping[str, str],
    body: bytes,
    *,
    secrets: str | None,
    tolerance: timedelta = WEBHOOK_TOLERANCE,
    now: float | None = None,
) -> Received:
    """A request the relay's http destination sent (any framework's headers, looked up
    without regard to case, and the raw body). With ``secrets`` (``whsec_...``,
    whitespace-separated, as the relay's ``--webhook-secret-file`` holds them) the
    Standard Webhooks signature is verified first, its timestamp within ``tolerance`` of
    ``now``, and ``Idempotency-Key`` must be the signed ``webhook-id``; ``secrets=None``
    accepts unsigned requests. :class:`WebhookRejected` says what to answer otherwise."""
    lower = {name.lower(): value for name, value in headers.items()}
    if secrets is not None:
        _verify(lower, body, _keys(secrets), tolerance, time.time() if now is None else now)
        if lower.get("idempotency-key") != lower["webhook-id"]:
            raise WebhookRejected("Idempotency-Key is not the signed webhook-id", 401)
    if lower.get("ce-specversion") or lower.get("content-type", "").startswith("application/cloudevents+json"):
        # A CloudEvent (--envelope cloudevents or cloudevents-json): its attributes carry the fields.
        kept = {k: v for k, v in lower.items() if k not in _NOT_PRODUCER or k == "content-type"}
        try:
            return _received(kept, body)
        except ValueError as exc:
            raise WebhookRejected(str(exc), 400) from None
    fields: dict[str, Any] = {}
    producer: dict[str, str] = {}
    for name, value in lower.items():
        field = name.removeprefix("relay-").replace("-", "_")
        if name.startswith("relay-") and field in _RELAY_FIELDS:
            fields[field] = value
        elif name not in _NOT_PRODUCER:
            producer[name] = value
    try:
        received = _received(fields, body, lower.get("idempotency-key"))
    except ValueError as exc:
        raise WebhookRejected(str(exc), 400) from None
    return dataclasses.replace(received, headers=producer)


def aiohttp_handler(
    consumer: Applier, *, secrets: str | None, tolerance: timedelta
) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    from aiohttp import web

    if secrets is not None:
        _keys(secrets)  # a malformed secret fails here, at start, not at the first request
    retry_after = str(max(1, math.ceil(consumer.retry_delay.total_seconds())))

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            event = received_from_webhook(request.headers, body, secrets=secrets, tolerance=tolerance)
        except WebhookRejected as exc:
            log.warning("request from %s refused (%s): %s", request.remote, exc.status, exc)
            return web.Response(status=exc.status, text=str(exc))
        try:
            verdict = await consumer.apply(event)
        except Exception:
            log.exception("event %s: not applied; the relay sends it again", event.event_id)
            return web.Response(status=500, text="not applied")
        if verdict is Verdict.OUT_OF_ORDER:
            # 409 with Retry-After: the relay defers the message that long, spending no attempt.
            early = "an earlier event of its aggregate first"
            return web.Response(status=409, text=early, headers={"Retry-After": retry_after})
        return web.Response(status=200, text=verdict.value)

    return handle
