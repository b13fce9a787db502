"""The ``nats`` destination: each outbox message is one JetStream publish.

``relay start --broker nats --nats-url nats://HOST:4222 --subject SUBJECT`` (or
``RELAY_NATS_URL`` and ``RELAY_SUBJECT``, or the ``[nats]`` table; routes take
``subject = "..."``). ``Nats-Msg-Id`` is the event id, so the stream drops a repeat inside
its ``duplicate_window``; each publish waits for the stream's acknowledgement, and a
duplicate acknowledgement counts as delivered. The relay's fields and the producer's
headers go as NATS headers.

Failures: no stream capturing the subject, the connection lost or reconnecting: held, no
attempt spent; no acknowledgement in time, other JetStream errors: retryable; a message
over the server's max_payload or a subject the template cannot make: permanent for that
message alone. nats-py is imported only when this destination is used.
"""

from __future__ import annotations

from relay.adapters.nats.settings import OPTIONS, NatsSettings
from relay.contract import DestinationSpec

__all__ = ["SPEC", "NatsSettings"]

SPEC = DestinationSpec(
    name="nats",
    settings=NatsSettings,
    publisher="relay.adapters.nats.publisher:NatsPublisher",
    options=OPTIONS,
    sdk_modules=("nats",),
    extra="outbox-relay[nats]",
)
