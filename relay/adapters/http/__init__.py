"""The ``http`` destination: each outbox message is one HTTP request to an external API or
webhook receiver.

``relay start --broker http --url URL`` (or ``RELAY_URL``, or ``url`` in the ``[http]``
table; routes take ``url = "..."``). The body is the payload as stored
(``Content-Type: application/json``); ``Idempotency-Key`` is the event's id, the same on
every retry, restart, replay and failover; the relay's fields go as ``Relay-*`` headers,
the producer's headers (trace context among them) as they are, but never credentials
(``Authorization``, ``Proxy-Authorization``, ``Cookie``); with a signing secret,
Standard Webhooks' ``webhook-id``, ``webhook-timestamp`` and ``webhook-signature``.

How answers are sorted: :mod:`relay.adapters.http.classify`. aiohttp is imported only
when this destination is used; this module and its options load without it.
"""

from __future__ import annotations

from relay.adapters.http.settings import OPTIONS, HttpSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "HttpSettings"]

SPEC = DestinationSpec(
    name="http",
    settings=HttpSettings,
    publisher="relay.adapters.http.publisher:HttpPublisher",
    options=OPTIONS,
    sdk_modules=("aiohttp", "multidict", "yarl", "aiohappyeyeballs", "aiosignal", "frozenlist", "propcache"),
    extra="outbox-relay[http]",
)
