"""The message a claim hands to a publisher, and the decision written back for it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, BinaryIO, Literal, get_args


@dataclass(frozen=True, eq=False)
class SpooledPayload:
    """A payload over the claim-check's threshold, read out of PostgreSQL a slice at a time
    into an anonymous temporary file (gone once closed, or when the process ends) instead of
    memory: a 100 MB payload passes through the relay in a slice's worth
    (relay.db.dispatch.OutboxStore, relay.claimcheck)."""

    file: BinaryIO
    size: int  # bytes of its JSON text
    sha256: bytes  # of those bytes

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One claimed outbox row, as the publisher sees it.

    ``id`` is the downstream de-duplication key: it never changes across retries.
    ``lease_version`` is the fencing token of this claim; adapters send it as a header
    so consumers can tell a stale worker's late delivery from the current one.
    """

    id: int
    aggregate_type: str
    aggregate_id: str
    event_type: str
    body: bytes  # the payload as JSON text, exactly as PostgreSQL rendered the jsonb
    attempt: int  # 1 on the first claim; a crash counts as an attempt
    lease_version: int
    ordered: bool  # routed through the ordered claim (at most one per aggregate in flight)
    age_s: float = 0.0  # seconds since created_at, by the database clock at claim time
    # The message's position in its aggregate's ordered sequence: 1, 2, 3, ... in commit
    # order, without gaps. None for unordered messages.
    aggregate_seq: int | None = None
    # The producer's own headers (the row's headers column), checked by producer_headers.
    headers: Mapping[str, str] | None = field(default=None, compare=False)
    # Set on a message `relay replay` sends again: the replay's run id, carried as the
    # ``replay`` header so consumers can tell a re-publication from the first delivery.
    replay: str | None = None
    # The event's identity (0015): a UUID, random, never handed out twice, not even by a
    # new primary after a failover that lost transactions (``id`` and ``aggregate_seq``
    # can be). Set on every claimed or replayed row; None only where a message is made by
    # hand.
    event_id: str | None = None
    # The epoch of ``aggregate_seq`` ('<timeline>.<first seq>.<token>'): numbers are
    # gapless within one epoch; a new one starts where the aggregate's counter starts
    # again. Ordered messages numbered since 0015 only.
    aggregate_epoch: str | None = None
    # When the producer wrote the row (its created_at): the CloudEvents ``time``.
    created_at: datetime | None = field(default=None, compare=False)
    # A payload over the claim-check's threshold, in a file (``body`` is then empty): only
    # relay.claimcheck reads it, and stores it; publishers get its reference.
    spooled: SpooledPayload | None = field(default=None, compare=False, repr=False)

    @property
    def body_size(self) -> int:
        """Bytes of the payload, wherever it is held."""
        return self.spooled.size if self.spooled is not None else len(self.body)

    def payload(self) -> Any:
        """The payload decoded from JSON (tests and simple publishers)."""
        return json.loads(self.body)

    def envelope(self) -> dict[str, str | int]:
        """What every broker carries beside the payload (AMQP headers, SQS message
        attributes, the log broker's JSON), for consumers to de-duplicate (``outbox_id``),
        route and order by without parsing the body; ``aggregate_seq`` on ordered
        messages only. Integers stay integers: each adapter types them for its wire."""
        fields: dict[str, str | int] = {
            "outbox_id": self.id,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "event_type": self.event_type,
            "attempt": self.attempt,
            "lease_version": self.lease_version,
        }
        if self.event_id is not None:
            fields["event_id"] = self.event_id
        if self.aggregate_seq is not None:
            fields["aggregate_seq"] = self.aggregate_seq
        if self.aggregate_epoch is not None:
            fields["aggregate_epoch"] = self.aggregate_epoch
        if self.replay is not None:
            fields["replay"] = self.replay
        if self.headers:
            # The producer's first, so that nothing of theirs can stand in for the relay's
            # (producer_headers refuses the relay's names anyway).
            fields = {**self.headers, **fields}
        return fields

    @property
    def dedup_id(self) -> str:
        """The de-duplication id for brokers that collapse resends themselves (SQS and SNS
        FIFO's MessageDeduplicationId): the event id (the outbox id where there is none),
        and for a replay the run id beside it, so that a replay inside AWS's five-minute
        window is not collapsed into the delivery it repeats (a resumed replay of the same
        run still is). Not the outbox id: a new primary after a failover may hand out again
        the ids of the transactions it lost, and AWS would drop those new events."""
        base = self.event_id or str(self.id)
        return base if self.replay is None else f"{base}-{self.replay}"

    def log_fields(self) -> dict[str, Any]:
        """The fields every log line about this message carries."""
        return log_fields(self.id, self.aggregate_id, self.event_type, self.lease_version)


# The names the relay sends itself; a producer header may not take one (``replay`` marks a
# re-published message, relay replay; ``payload`` is the log broker's key for the body).
RELAY_HEADERS = frozenset(
    {
        "outbox_id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "attempt",
        "lease_version",
        "aggregate_seq",
        "event_id",
        "aggregate_epoch",
        "replay",
        "payload",
    }
)
# The claim-check's headers (relay.claimcheck): where a payload is stored and what it hashes
# to. Only the relay says so; a producer's would send consumers to fetch an object of its
# choosing in place of the payload.
CLAIM_CHECK_HEADERS = frozenset({"dataref", "datadigest"})
# A header name: what AMQP (a short string) and SQS/SNS (letters, digits, _ - .; at most 256
# characters, not starting with AWS. or Amazon.) both take.
_HEADER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
MAX_HEADER_VALUE_CHARS = 4096


def decode_headers(text: str | bytes | None) -> dict[str, str] | None:
    """A claimed row's headers column (jsonb, as its JSON text) as the relay sends them:
    :func:`producer_headers` of the decoded value. ValueError, saying why, for anything
    it refuses, whatever the text holds: a value nested too deep for Python's decoder
    (PostgreSQL stores jsonb some 20,000 levels deep; Python's recursion limit is about
    1,000) is refused like any other value that is not an object of strings, never an
    exception that leaves the worker."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError("headers must be a JSON object of string values, not a value nested this deep") from None
    return producer_headers(value)


def producer_headers(value: Any) -> dict[str, str] | None:
    """The producer's headers of a claimed row as the relay sends them, or None when the
    row has none; ValueError, saying why, for headers the relay refuses (the message then
    goes to dead alone): not a JSON object, a value that is not a string, a name brokers
    refuse or one of the relay's own (:data:`RELAY_HEADERS`, :data:`CLAIM_CHECK_HEADERS`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"headers must be a JSON object of string values, not {type(value).__name__}")
    for name, text in value.items():
        if name in RELAY_HEADERS or name in CLAIM_CHECK_HEADERS:
            raise ValueError(f"header {name!r} is one of the relay's own and cannot be set by a producer")
        if not _HEADER_NAME.fullmatch(name) or name.lower().startswith(("aws.", "amazon.")):
            raise ValueError(
                f"header name {name[:80]!r} is not one brokers take (letters, digits, _ - . only, at most 255;"
                " not starting with AWS. or Amazon.)"
            )
        if not isinstance(text, str):
            raise ValueError(f"header {name!r} must be a string, not {type(text).__name__}")
        if not text or len(text) > MAX_HEADER_VALUE_CHARS:
            raise ValueError(f"header {name!r} must be 1 to {MAX_HEADER_VALUE_CHARS} characters")
    return dict(value) or None


def log_fields(outbox_id: int, aggregate_id: str, event_type: str, lease_version: int) -> dict[str, Any]:
    """What every log line about one outbox row carries (as ``extra``), whoever logs it."""
    return {
        "outbox_id": outbox_id,
        "aggregate_id": aggregate_id,
        "event_type": event_type,
        "lease_version": lease_version,
    }


# What became of one message: the Decision's kind, the `outcome` label of
# outbox_relay_messages_total, the WorkerStats counter and the log's "outcome" field, one
# spelling everywhere.
Kind = Literal["published", "retried", "deferred", "dead", "released", "broker_unavailable"]
KINDS: tuple[Kind, ...] = get_args(Kind)
Status = Literal["done", "pending", "dead"]


@dataclass(frozen=True, slots=True)
class Decision:
    """What finalize writes for one message; build it with the constructors below so only
    valid combinations exist (River's one-constructor-per-outcome habit)."""

    message: OutboxMessage
    kind: Kind
    status: Status
    delay_s: float = 0.0
    error: str | None = None
    refund: bool = False

    @classmethod
    def published(cls, message: OutboxMessage) -> Decision:
        return cls(message, "published", "done")

    @classmethod
    def retry(cls, message: OutboxMessage, delay_s: float, error: str) -> Decision:
        return cls(message, "retried", "pending", delay_s=delay_s, error=error)

    @classmethod
    def defer(cls, message: OutboxMessage, delay_s: float, reason: str) -> Decision:
        return cls(message, "deferred", "pending", delay_s=delay_s, error=f"deferred: {reason}", refund=True)

    @classmethod
    def dead(cls, message: OutboxMessage, error: str) -> Decision:
        return cls(message, "dead", "dead", error=error)

    @classmethod
    def released(cls, message: OutboxMessage, reason: str = "released unpublished at shutdown") -> Decision:
        """Hand an unpublished message back at once, refunding the attempt."""
        return cls(message, "released", "pending", refund=True, error=reason)

    @classmethod
    def broker_unavailable(cls, message: OutboxMessage, delay_s: float, error: str) -> Decision:
        """Back to pending with the attempt refunded: the broker, not the message, failed."""
        return cls(message, "broker_unavailable", "pending", delay_s=delay_s, error=error, refund=True)
