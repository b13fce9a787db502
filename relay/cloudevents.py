"""CloudEvents 1.0 envelopes (``--envelope cloudevents`` or ``cloudevents-json``): how an
outbox message reads to consumers that expect CloudEvents rather than the relay's own
headers (Knative, Dapr, Event Grid, most webhook receivers).

The context attributes come from the row: ``id`` is the event id (the same across
retries, replays and failovers, so consumers de-duplicate by it), ``type`` the event type,
``subject`` the aggregate id, ``time`` the row's ``created_at``, ``source`` what the
operator configures (``--cloudevents-source``), ``datacontenttype`` ``application/json``
(the payload is the row's JSON). What the relay's own envelope carries besides travels as
extension attributes, named as the specification asks (lowercase letters and digits):
``outboxid``, ``aggregatetype``, ``aggregateseq``, ``aggregateepoch``, ``leaseversion``,
``attempt`` and ``replay``; trace context as the distributed-tracing extension
(``traceparent``, ``tracestate``). A producer's own header whose name is a valid attribute
name becomes an extension too; the others stay plain transport headers beside them.

Binary mode puts the attributes in the transport's headers under its binding's prefix
(``ce-`` for HTTP and NATS, ``ce_`` for Kafka) and the payload in the body unchanged;
structured mode (``application/cloudevents+json``) puts everything in one JSON body.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC
from typing import Literal

from relay.message import OutboxMessage

SPECVERSION = "1.0"
JSON = "application/json"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json; charset=utf-8"
# The relay's envelope fields and the extension attributes that carry them.
EXTENSIONS = {
    "outbox_id": "outboxid",
    "aggregate_type": "aggregatetype",
    "aggregate_seq": "aggregateseq",
    "aggregate_epoch": "aggregateepoch",
    "lease_version": "leaseversion",
    "attempt": "attempt",
    "replay": "replay",
}
# An attribute name as CloudEvents 1.0 allows it (it recommends at most 20 characters).
ATTRIBUTE_NAME = re.compile(r"[a-z0-9]{1,20}\Z")
# The context attributes a producer's header may not take (the relay sets them).
_RESERVED = frozenset(
    {"specversion", "id", "source", "type", "subject", "time", "datacontenttype", "dataschema", "data", "data_base64"}
) | frozenset(EXTENSIONS.values())

Envelope = Literal["relay", "cloudevents", "cloudevents-json"]
ENVELOPES: tuple[Envelope, ...] = ("relay", "cloudevents", "cloudevents-json")


@dataclass(frozen=True)
class CloudEvents:
    """How a destination writes CloudEvents: ``structured`` (one JSON body) or binary, and
    the ``source`` attribute every event carries."""

    source: str
    structured: bool = False


def attributes(m: OutboxMessage, source: str) -> dict[str, str | int]:
    """The context and extension attributes of ``m``, binding-neutral (integers stay
    integers; each binding writes them as its headers take them)."""
    attrs: dict[str, str | int] = {
        "specversion": SPECVERSION,
        "id": m.event_id or str(m.id),
        "source": source,
        "type": m.event_type,
        "subject": m.aggregate_id,
        "datacontenttype": JSON,
    }
    if m.created_at is not None:
        attrs["time"] = m.created_at.astimezone(UTC).isoformat().replace("+00:00", "Z")
    for field, value in m.envelope().items():
        name = EXTENSIONS.get(field)
        if name is not None:
            attrs[name] = value
        elif field not in EXTENSIONS and ATTRIBUTE_NAME.match(field) and field not in _RESERVED:
            attrs[field] = value  # a producer's header (traceparent and tracestate among them)
    return attrs


def plain_headers(m: OutboxMessage) -> dict[str, str]:
    """A producer's headers that cannot be attributes (their names): sent as they are."""
    return {k: v for k, v in (m.headers or {}).items() if not ATTRIBUTE_NAME.match(k) or k in _RESERVED}


def binary_headers(m: OutboxMessage, source: str, prefix: str) -> dict[str, str]:
    """Binary mode: every attribute as a ``prefix``-named header (``datacontenttype`` is the
    transport's content type, named by the binding, so it is left to the caller), and the
    producer's other headers as they are."""
    headers = {f"{prefix}{k}": str(v) for k, v in attributes(m, source).items() if k != "datacontenttype"}
    return {**plain_headers(m), **headers}


def structured_body(m: OutboxMessage, source: str) -> bytes:
    """Structured mode: the attributes and the payload (as JSON, not as a string) in one
    ``application/cloudevents+json`` document."""
    attrs = attributes(m, source)
    # The payload is the row's JSON text already: spliced in, not parsed and dumped again.
    head = json.dumps(attrs, ensure_ascii=False, separators=(",", ":"))
    return head[:-1].encode() + b',"data":' + (m.body or b"null") + b"}"


def body_for(m: OutboxMessage, cloudevents: CloudEvents | None) -> bytes:
    """What carries ``m`` on the wire: the payload, or in structured mode the CloudEvent
    around it (binary mode and the relay's envelope send the payload as it is)."""
    if cloudevents is not None and cloudevents.structured:
        return structured_body(m, cloudevents.source)
    return m.body
