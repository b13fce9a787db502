"""Turning an outbox message into an SQS or SNS batch entry's parts, and packing entries into requests.

The body is the payload JSON exactly as PostgreSQL rendered it. The envelope travels as
message attributes (the same on SQS and SNS, which hands them on to its subscribers), so
consumers can route and de-duplicate without parsing the body:

===============  ======  =====================================================
attribute        type    value
===============  ======  =====================================================
event_id         String  the event's identity (a UUID): the de-duplication key
outbox_id        Number  the outbox row's id (for people: ``relay explain``)
aggregate_type   String  e.g. ``order`` (left out when empty: AWS refuses empty values)
aggregate_id     String  the aggregate the event belongs to
event_type       String  e.g. ``OrderPaid``
aggregate_seq    Number  ordered messages only: 1, 2, 3, ... per aggregate in commit order
aggregate_epoch  String  ordered messages only: the epoch of aggregate_seq
===============  ======  =====================================================

``attempt`` and ``lease_version``, which AMQP headers and the log broker carry, are left
out here (since 0015): a message takes at most 10 attributes, and the event identity
took their two places, so producers keep 3 (2 in a replay) for their own headers. SQS
counts receives itself (``ApproximateReceiveCount``).

On a FIFO queue or topic ``MessageDeduplicationId`` is the outbox id (a replay adds its run
id, OutboxMessage.dedup_id), so a resend within
the five-minute window is collapsed by AWS itself, and ``MessageGroupId`` is the aggregate
id for every message, ordered or not: a consumer then sees one ordered stream per
aggregate, as in the outbox. An aggregate id AWS does not accept as a group id (over 128
characters, or characters outside printable ASCII) is replaced by a digest of it, which
keeps one group per aggregate.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from relay.cloudevents import STRUCTURED_CONTENT_TYPE, CloudEvents, body_for, plain_headers
from relay.errors import NoRoomForReplayMarker, PermanentError
from relay.message import RELAY_HEADERS, OutboxMessage

# Characters SQS and SNS accept in bodies and attribute values (XML 1.0's Char production).
_REFUSED_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId: 1 to 128 characters of printable ASCII, no space.
_GROUP_ID = re.compile(r"^[!-~]{1,128}$")

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Entry(Generic[R]):
    """A message ready to send: its request entry (the service's own shape), its size as
    AWS counts it, and the entry's ``Id`` (the outbox id) that AWS's answer names it by."""

    request: R
    size: int
    id: str


@dataclass(frozen=True, slots=True)
class Checked:
    """What both services send of a message, checked: the body as text, the envelope's
    attributes as ``(name, DataType, value)``, and the size AWS counts."""

    id: str
    body: str
    attributes: tuple[tuple[str, str, str], ...]
    size: int


def group_id(aggregate_id: str) -> str:
    """The MessageGroupId for an aggregate: the id itself when AWS accepts it."""
    if _GROUP_ID.match(aggregate_id):
        return aggregate_id
    return "sha256-" + hashlib.sha256(aggregate_id.encode()).hexdigest()


# Message attributes one SQS message or SNS notification may carry.
MAX_ATTRIBUTES = 10


# Envelope fields AWS messages leave out (see the table above).
LEFT_OUT = frozenset({"attempt", "lease_version"})

# Fields of OutboxMessage.envelope() one message can carry (the SQS and SNS specs'
# max_envelope_fields; relay.tracing leaves a traceparent out past it): the attributes AWS
# takes, and the fields these adapters leave out on top.
MAX_ENVELOPE_FIELDS = MAX_ATTRIBUTES + len(LEFT_OUT)


def attributes(message: OutboxMessage) -> tuple[tuple[str, str, str], ...]:
    """The envelope as message attributes: the relay's 5 to 7, and the producer's headers
    (as String attributes; :data:`MAX_ATTRIBUTES` in all)."""
    return tuple(
        (name, "Number" if isinstance(value, int) else "String", str(value))
        for name, value in message.envelope().items()
        if value != "" and name not in LEFT_OUT  # AWS refuses an empty attribute value
    )


def message_size(body: bytes, attrs: Sequence[tuple[str, str, str]]) -> int:
    """A message's size as SQS and SNS limit it: body, plus each attribute's name, type and
    value (``body`` as UTF-8, the bytes the claim got)."""
    return len(body) + sum(len(name) + len(kind) + len(value.encode()) for name, kind, value in attrs)


def cloudevent_attributes(message: OutboxMessage) -> tuple[tuple[str, str, str], ...]:
    """A structured CloudEvent's message attributes: its content type, and the producer's
    headers that are no CloudEvents attribute (the others are in the body)."""
    plain = tuple((name, "String", value) for name, value in plain_headers(message).items() if value != "")
    return (("content-type", "String", STRUCTURED_CONTENT_TYPE), *plain)


def check(
    message: OutboxMessage, *, max_bytes: int, service: str, destination: str, cloudevents: CloudEvents | None = None
) -> Checked | PermanentError:
    """``message``'s parts, or the PermanentError that keeps it from being sent at all.

    Size and characters are checked here, so a message AWS would refuse whatever happens
    goes to 'dead' without a request, and never takes a whole request down with it. The
    size comes first: a payload too large is refused before it is decoded (a copy of it).
    ``service`` ("SQS") and ``destination`` ("the SQS queue") name them in the errors.
    """
    # Structured CloudEvents (the only mode here) carry their attributes, the replay marker
    # among them, in the body.
    payload = body_for(message, cloudevents)
    attrs = attributes(message) if cloudevents is None else cloudevent_attributes(message)
    marker = next(((n, k, v) for n, k, v in attrs if n == "replay"), None)
    if len(attrs) > MAX_ATTRIBUTES and marker is not None and len(attrs) - 1 <= MAX_ATTRIBUTES:
        return NoRoomForReplayMarker(
            f"{len(attrs)} message attributes with the replay marker; {service} allows at most {MAX_ATTRIBUTES}:"
            f" the message went out live with {len(attrs) - 1}, and a replay cannot send it without its marker"
        )
    if len(attrs) > MAX_ATTRIBUTES:
        extra = len(attrs) - sum(1 for name, _, _ in attrs if name in RELAY_HEADERS)
        return PermanentError(
            f"{len(attrs)} message attributes ({extra} from the producer's headers); {service} allows at most"
            f" {MAX_ATTRIBUTES}, so a message carries at most {MAX_ATTRIBUTES - len(attrs) + extra} producer headers"
        )
    size = message_size(payload, attrs)
    if marker is not None and size > max_bytes >= size - message_size(b"", (marker,)):
        return NoRoomForReplayMarker(
            f"message is {size} bytes with its attributes and the replay marker; {destination} takes at most"
            f" {max_bytes}: it went out live without the marker, and a replay cannot send it without it"
        )
    if size > max_bytes:
        return PermanentError(f"message is {size} bytes with its attributes; {destination} takes at most {max_bytes}")
    try:
        body = payload.decode()
    except UnicodeDecodeError:
        return PermanentError(f"payload is not valid UTF-8; {service} bodies are text")
    for where, text in (("payload", body), *((f"attribute {n}", v) for n, _, v in attrs)):
        bad = _REFUSED_CHARS.search(text)
        if bad:
            return PermanentError(f"{where} holds character U+{ord(bad.group()):04X}, which {service} does not accept")
    # Unique within a request (a batch never holds one row twice) and readable in AWS's answers.
    return Checked(str(message.id), body, attrs, size)


def pack(indices: Sequence[int], sizes: Mapping[int, int], *, max_entries: int, max_bytes: int) -> list[list[int]]:
    """Group ``indices`` into requests of at most ``max_entries`` entries and ``max_bytes``
    bytes, keeping their order. An entry larger than ``max_bytes`` goes alone."""
    requests: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i in indices:
        if current and (len(current) >= max_entries or current_bytes + sizes[i] > max_bytes):
            requests.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += sizes[i]
    if current:
        requests.append(current)
    return requests
