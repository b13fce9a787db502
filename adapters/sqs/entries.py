"""Turning an outbox message into a ``SendMessageBatch`` entry, and packing entries into requests.

The body is the payload JSON exactly as PostgreSQL rendered it. The envelope travels as
message attributes, so consumers can route and de-duplicate without parsing the body:

===============  ======  =====================================================
attribute        type    value
===============  ======  =====================================================
outbox_id        Number  the outbox row's id: the de-duplication key
aggregate_type   String  e.g. ``order`` (left out when empty: SQS refuses empty values)
aggregate_id     String  the aggregate the event belongs to
event_type       String  e.g. ``OrderPaid``
attempt          Number  1 on the first delivery attempt
lease_version    Number  the claim's fencing token: a later one supersedes an earlier one
aggregate_seq    Number  ordered messages only: 1, 2, 3, ... per aggregate in commit order
===============  ======  =====================================================

On a FIFO queue ``MessageDeduplicationId`` is the outbox id, so a resend within SQS's
five-minute window is collapsed by SQS itself, and ``MessageGroupId`` is the aggregate
id for every message, ordered or not: a consumer then sees one ordered stream per
aggregate, as in the outbox. An aggregate id SQS does not accept as a group id (over 128
characters, or characters outside printable ASCII) is replaced by a digest of it, which
keeps one group per aggregate.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relay.errors import PermanentError
from relay.message import OutboxMessage

if TYPE_CHECKING:
    from mypy_boto3_sqs.type_defs import MessageAttributeValueTypeDef, SendMessageBatchRequestEntryTypeDef

# Characters SQS accepts in bodies and attribute values (XML 1.0's Char production).
_REFUSED_CHARS = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId: 1 to 128 characters of printable ASCII, no space.
_GROUP_ID = re.compile(r"^[!-~]{1,128}$")


@dataclass(frozen=True, slots=True)
class Entry:
    """A message ready to send: its request entry and its size as SQS counts it."""

    request: SendMessageBatchRequestEntryTypeDef
    size: int


def group_id(aggregate_id: str) -> str:
    """The MessageGroupId for an aggregate: the id itself when SQS accepts it."""
    if _GROUP_ID.match(aggregate_id):
        return aggregate_id
    return "sha256-" + hashlib.sha256(aggregate_id.encode()).hexdigest()


def attributes(message: OutboxMessage) -> dict[str, MessageAttributeValueTypeDef]:
    """The envelope as SQS message attributes (7 of the 10 SQS allows)."""
    return {
        name: {"DataType": "Number" if isinstance(value, int) else "String", "StringValue": str(value)}
        for name, value in message.envelope().items()
        if value != ""  # SQS refuses an empty attribute value
    }


def sqs_size(body: bytes, attrs: dict[str, MessageAttributeValueTypeDef]) -> int:
    """A message's size as SQS limits it: body, plus each attribute's name, type and value
    (``body`` as UTF-8, the bytes the claim got)."""
    size = len(body)
    for name, value in attrs.items():
        size += len(name) + len(value["DataType"]) + len(value.get("StringValue", "").encode())
    return size


def prepare(message: OutboxMessage, *, fifo: bool, max_bytes: int) -> Entry | PermanentError:
    """The entry for ``message``, or the PermanentError that keeps it from being sent at all.

    Size and characters are checked here, so a message SQS would refuse whatever happens
    goes to 'dead' without a request, and never takes a whole request down with it. The
    size comes first: a payload too large is refused before it is decoded (a copy of it).
    """
    attrs = attributes(message)
    size = sqs_size(message.body, attrs)
    if size > max_bytes:
        return PermanentError(f"message is {size} bytes with its attributes; the SQS queue takes at most {max_bytes}")
    try:
        body = message.body.decode()
    except UnicodeDecodeError:
        return PermanentError("payload is not valid UTF-8; SQS bodies are text")
    for where, text in (("payload", body), *((f"attribute {n}", v.get("StringValue", "")) for n, v in attrs.items())):
        bad = _REFUSED_CHARS.search(text)
        if bad:
            return PermanentError(f"{where} holds character U+{ord(bad.group()):04X}, which SQS does not accept")
    request: SendMessageBatchRequestEntryTypeDef = {
        # Unique within a request (a batch never holds one row twice) and readable in SQS's answers.
        "Id": str(message.id),
        "MessageBody": body,
        "MessageAttributes": attrs,
    }
    if fifo:
        request["MessageGroupId"] = group_id(message.aggregate_id)
        request["MessageDeduplicationId"] = str(message.id)
    return Entry(request, size)


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
