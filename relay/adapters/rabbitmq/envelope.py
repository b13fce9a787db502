"""Turning an outbox message into the AMQP message the broker gets, and refusing, before
anything is sent, the messages the broker or the client library could never take."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from datetime import UTC, datetime

from pamqp import commands as spec
from pamqp.common import FieldValue

from relay.adapters.rabbitmq.settings import RabbitSettings
from relay.cloudevents import STRUCTURED_CONTENT_TYPE, CloudEvents, binary_headers, body_for, plain_headers
from relay.errors import PermanentError
from relay.message import OutboxMessage

# AMQP caps a routing key (a shortstr) at 255 bytes; aiormq raises ValueError past it.
MAX_ROUTING_KEY_BYTES = 255
# A content-header frame carries the properties and headers and cannot be split across
# frames. Besides the encoded properties it holds 7 bytes of frame header, 12 of
# class/weight/body size and the frame-end octet.
HEADER_FRAME_OVERHEAD = 7 + 12 + 1
# RabbitMQ's smallest allowed frame_max; used until the connection has negotiated one.
MIN_FRAME_MAX = 4096
# AMQP's short strings (the `type` property among them) hold at most 255 bytes.
MAX_SHORTSTR_BYTES = 255
# Generous bound on everything in the encoded properties besides the headers and the
# event type: ids, timestamp, content type, app id, delivery mode, flags.
FIXED_PROPERTY_BYTES = 512
# A header table entry besides its name and value: the name's length octet, the value's
# type tag and 4-byte length.
FIELD_OVERHEAD_BYTES = 6
APP_ID = "outbox-relay"
PERSISTENT = 2  # delivery mode: the broker writes the message to disk


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message ready to publish: the outbox row it came from, the AMQP properties
    (headers included) it goes out with, and its routing key."""

    source: OutboxMessage
    properties: spec.Basic.Properties
    routing_key: str
    body: bytes  # the payload, or with --envelope cloudevents-json the structured CloudEvent


def headers_for(m: OutboxMessage, cloudevents: CloudEvents | None = None) -> dict[str, FieldValue]:
    """The headers a consumer de-duplicates and orders by, whatever the routing;
    ``aggregate_seq`` (an integer) on ordered messages only. With ``cloudevents``: the
    RabbitMQ binding's ``ce-`` attributes (binary mode), or in structured mode only the
    producer's headers that are no attribute (the attributes are in the body)."""
    if cloudevents is None:
        headers: dict[str, FieldValue] = dict(m.envelope())
        return headers
    if cloudevents.structured:
        return dict(plain_headers(m))
    return dict(binary_headers(m, cloudevents.source, "ce-"))


def build(
    m: OutboxMessage,
    settings: RabbitSettings,
    frame_max: int,
    learned_max_size: int | None = None,
    timestamp: datetime | None = None,
) -> Envelope | PermanentError:
    """The envelope for ``m``, or the PermanentError saying why it can never be sent.

    Every check here stands in for a failure that would otherwise happen on the wire and
    take the whole channel (an oversized body) or even the connection (a header frame over
    frame_max) down with it, failing the innocent messages of the batch too.
    ``learned_max_size`` is the broker's limit when a 406 showed it to be lower than
    ``--amqp-max-message-size``; ``timestamp`` (default: now) is shared by a batch.
    """
    ce = settings.cloudevents
    body = body_for(m, ce)
    if len(body) > settings.max_message_size:
        return PermanentError(
            f"message body of {len(body)} bytes exceeds the broker's max message size of"
            f" {settings.max_message_size} bytes (--amqp-max-message-size); not sent"
        )
    if learned_max_size is not None and len(body) > learned_max_size:
        return PermanentError(
            f"message body of {len(body)} bytes exceeds the broker's max_message_size of"
            f" {learned_max_size} bytes (reported by the broker earlier); not sent"
        )
    routing_key = settings.routing_key.render(m)
    key_bytes = len(routing_key) if routing_key.isascii() else len(routing_key.encode("utf-8", "surrogatepass"))
    if key_bytes > MAX_ROUTING_KEY_BYTES:
        return PermanentError(
            f"routing key of {key_bytes} bytes (from template {settings.routing_key.text!r}) exceeds"
            f" AMQP's {MAX_ROUTING_KEY_BYTES}; not sent"
        )
    headers = headers_for(m, ce)
    try:
        properties = spec.Basic.Properties(
            content_type=STRUCTURED_CONTENT_TYPE if ce is not None and ce.structured else "application/json",
            delivery_mode=PERSISTENT,
            headers=headers,
            message_id=m.event_id or str(m.id),
            message_type=m.event_type,
            # Publish time: the row's created_at is not part of the claimed message.
            timestamp=timestamp or datetime.now(UTC),
            app_id=APP_ID,
        )
    except (TypeError, ValueError) as exc:  # pamqp validates some fields on construction
        return PermanentError(f"AMQP properties or headers cannot be encoded: {exc}; not sent")
    if not _surely_encodable(m, headers, frame_max):
        # Encode them exactly as the client will: pamqp raises TypeError for a shortstr
        # over 255 bytes (`type` is one) or a value it has no AMQP type for, and
        # UnicodeEncodeError for text that is not UTF-8; mid-publish, that would fail the
        # batch. And the header frame cannot be split: over frame_max the broker closes
        # the connection.
        try:
            encoded = properties.marshal()
        except (TypeError, ValueError, OverflowError, struct.error) as exc:
            return PermanentError(f"AMQP properties or headers cannot be encoded: {exc}; not sent")
        header_frame = len(encoded) + HEADER_FRAME_OVERHEAD
        if header_frame > frame_max:
            theirs = m.headers or {}
            given = sum(len(k) + len(v.encode("utf-8", "surrogatepass")) for k, v in theirs.items())
            return PermanentError(
                f"AMQP properties and headers take {header_frame} bytes ({len(theirs)} producer headers of"
                f" {given} bytes among them), more than the connection's frame_max of {frame_max}: one"
                " content-header frame must hold them all; not sent"
            )
    return Envelope(m, properties, routing_key, body)


def _surely_encodable(m: OutboxMessage, headers: dict[str, FieldValue], frame_max: int) -> bool:
    """True when the properties cannot fail to encode or outgrow a frame, without encoding
    them (which costs as much again as building them): every text is ASCII, the event type
    fits a shortstr, and all of it, every header included (the producer's, the replay
    marker, trace context: whatever the message carries), takes far less than a frame."""
    if len(m.event_type) > MAX_SHORTSTR_BYTES or not m.event_type.isascii():
        return False
    total = FIXED_PROPERTY_BYTES + len(m.event_type)  # the `type` property repeats it
    for name, value in headers.items():
        if isinstance(value, str):
            if not value.isascii():
                return False
            total += len(name) + len(value) + FIELD_OVERHEAD_BYTES
        else:
            total += len(name) + FIELD_OVERHEAD_BYTES + 8
    return total < frame_max
