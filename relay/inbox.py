"""The consumer's inbox: each event's effect applied exactly once, in its aggregate's order.

The relay delivers at least once; a consumer makes that exactly once by recording each
event it applies in the same transaction as the effect, in its own PostgreSQL::

    from relay import Inbox, OutOfOrder, received_from_aio_pika

    inbox = Inbox()                          # public.inbox; Inbox.migrate(conn) creates it

    async def handle(message):               # aio-pika, manual acknowledgement
        event = received_from_aio_pika(message)
        try:
            async with pool.connection() as conn, conn.transaction():   # this message's own
                if await inbox.receive_async(conn, event):
                    await apply_effect(conn, event.payload())   # same transaction
        except OutOfOrder:
            await asyncio.sleep(0.5)
            await message.reject(requeue=True)  # an earlier event is missing: let it come first
            return
        await message.ack()                  # committed, or a duplicate: done either way

(:class:`relay.Consumer` is that, for each destination.) One connection per message: a
broker client runs deliveries concurrently, and deliveries sharing one connection share
its transaction. :class:`ConnectionShared` refuses what of that can be seen cheaply.

:meth:`Inbox.receive` answers True for an event to apply now, False for a duplicate (the
same ``event_id`` was applied, or an ordered event's number was), and raises
:class:`OutOfOrder` when an ordered event comes before an earlier one of its aggregate
(nothing is recorded then: roll back, and let the broker deliver it again later).

Why ``event_id`` and not ``outbox_id``: after a failover with asynchronous replication the
new primary numbers new events again from what it had replicated, and may hand out again
the outbox ids of the transactions it lost. ``event_id`` is random, so never reused; and every ordered event
carries ``aggregate_epoch``, which changes when the relay's counter for the aggregate
starts again (such a failover, or an aggregate the relay forgot), so a number used again
in a new epoch is told apart from a duplicate, and an old epoch from a newer one.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

import psycopg

from relay._transactions import async_runner, first, sync_runner
from relay.cloudevents import EXTENSIONS
from relay.db.inbox import InboxStatements
from relay.db.names import OutboxNames
from relay.errors import ConfigError
from relay.message import RELAY_HEADERS

__all__ = [
    "ConnectionShared",
    "Inbox",
    "OutOfOrder",
    "Received",
    "received_from_aio_pika",
    "received_from_kafka",
    "received_from_nats",
    "received_from_sns",
    "received_from_sqs",
]


@dataclass(frozen=True, slots=True)
class Received:
    """What a consumer got, as the inbox reads it: the relay's envelope and the body.

    Build it with :func:`received_from_aio_pika`, :func:`received_from_sqs` or
    :func:`received_from_sns`.
    """

    event_id: uuid.UUID
    aggregate_type: str
    aggregate_id: str
    event_type: str
    body: bytes
    aggregate_seq: int | None = None
    aggregate_epoch: str | None = None
    outbox_id: int | None = None
    # The run id of the `relay replay` that sent it again; None on a live delivery.
    replay: str | None = None
    # The producer's own headers (and trace context), everything the relay did not add.
    headers: Mapping[str, str] = field(default_factory=dict)
    # A claim-checked event's payload, fetched and checked by relay.Consumer into a file of
    # its own (``body`` is then the reference); None when the body is the payload.
    payload_path: Path | None = field(default=None, compare=False)

    def payload(self) -> Any:
        """The payload decoded from JSON (fetched, for a claim-checked event)."""
        if self.payload_path is not None:
            with self.payload_path.open("rb") as fh:
                return json.load(fh)
        return json.loads(self.body)

    def open_payload(self) -> BinaryIO:
        """The payload as a binary file, read as a stream: a claim-checked event's from the
        file it was fetched into (of any size, in bounded memory), another's from its body."""
        if self.payload_path is not None:
            return self.payload_path.open("rb")
        return io.BytesIO(self.body)

    @property
    def claim_checked(self) -> bool:
        """The message carries a reference to its payload (``dataref``), not the payload."""
        return "dataref" in self.headers


class ConnectionShared(ConfigError):
    """The connection (or the transaction it is in) is used by another task or thread at the
    same time, as when aio-pika's concurrent deliveries share one ``AsyncConnection``: their
    transactions interleave on it, and a receipt commits or rolls back with another
    message's effect. Nothing was recorded. Give each message a connection of its own for
    its transaction (a ``psycopg_pool`` pool; :class:`relay.Consumer` does)."""


class OutOfOrder(Exception):
    """An ordered event came before an earlier event of its aggregate. Nothing was
    recorded; roll back and let the broker deliver it again (RabbitMQ: reject with
    requeue, or nack to a delay queue; SQS: leave it, the visibility timeout returns it)."""

    def __init__(self, received: Received, expected: int) -> None:
        super().__init__(
            f"aggregate {received.aggregate_id!r}: got aggregate_seq {received.aggregate_seq},"
            f" waiting for {expected} first"
        )
        self.received = received
        self.expected = expected


# What the relay itself puts beside the body (the producer's own headers are the rest).
_RELAY_FIELDS = RELAY_HEADERS


# A CloudEvent's attributes (--envelope cloudevents or cloudevents-json) that carry the
# relay's fields; its other context attributes are dropped, its other extensions (trace
# context, dataref and datadigest, a producer's own) become headers.
_FROM_CLOUDEVENTS = {"id": "event_id", "type": "event_type", "subject": "aggregate_id"} | {
    name: field for field, name in EXTENSIONS.items()
}
_CLOUDEVENTS_CONTEXT = frozenset({"specversion", "source", "time", "datacontenttype", "dataschema"})
# Binary mode's header prefixes: HTTP, NATS and AMQP (ce-), Kafka (ce_).
_CLOUDEVENTS_PREFIXES = ("ce-", "ce_")
_CONTENT_TYPES = frozenset({"content-type", "content_type"})


def _as_text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cloudevent(
    fields: Mapping[str, Any], body: bytes, content_type: str | None
) -> tuple[dict[str, Any], bytes] | None:
    """``fields`` and ``body`` as the relay's envelope reads them, when they are a CloudEvent
    (binary: prefixed headers and the payload; structured: one JSON document); None when
    they are not one."""
    if content_type is None:
        content_type = next((_as_text(v) for k, v in fields.items() if k.lower() in _CONTENT_TYPES), "")
    transport = {k: v for k, v in fields.items() if k.lower() not in _CONTENT_TYPES}
    if content_type.lower().startswith("application/cloudevents+json"):
        try:
            document = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"a structured CloudEvent whose body is not JSON: {exc}") from None
        except RecursionError:  # nested deeper than Python's decoder goes: refused like the rest
            raise ValueError("a structured CloudEvent whose body is nested too deep to read") from None
        if not isinstance(document, dict):
            raise ValueError("a structured CloudEvent whose body is not a JSON object")
        attributes = {k: v for k, v in document.items() if k not in ("data", "data_base64")}
        if "data_base64" in document:
            data = base64.b64decode(str(document["data_base64"]))
        else:
            data = json.dumps(document.get("data"), ensure_ascii=False).encode()
    else:
        prefix = next((p for p in _CLOUDEVENTS_PREFIXES if f"{p}specversion" in {k.lower() for k in fields}), None)
        if prefix is None:
            return None
        attributes = {k[len(prefix) :].lower(): v for k, v in transport.items() if k.lower().startswith(prefix)}
        transport = {k: v for k, v in transport.items() if not k.lower().startswith(prefix)}
        data = body
    mapped: dict[str, Any] = dict(transport)
    for name, value in attributes.items():
        if name not in _CLOUDEVENTS_CONTEXT:
            mapped[_FROM_CLOUDEVENTS.get(name, name)] = _as_text(value)
    return mapped, data


def _received(
    fields: Mapping[str, Any], body: bytes, event_id: Any = None, content_type: str | None = None
) -> Received:
    cloudevent = _cloudevent(fields, body, content_type)
    if cloudevent is not None:
        fields, body = cloudevent
        event_id = None

    def text(name: str) -> str | None:
        value = fields.get(name)
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def number(name: str) -> int | None:
        value = text(name)
        return None if value is None else int(value)

    raw_id = text("event_id") or (str(event_id) if event_id else None)
    if raw_id is None:
        raise ValueError("the message carries no event_id: was it sent by outbox-relay 0015 or later?")
    missing = [name for name in ("aggregate_id", "event_type") if text(name) is None]
    if missing:
        raise ValueError(f"the message carries no {', '.join(missing)}: not one outbox-relay sent")
    return Received(
        event_id=uuid.UUID(raw_id),
        aggregate_type=text("aggregate_type") or "",
        aggregate_id=text("aggregate_id") or "",
        event_type=text("event_type") or "",
        body=body,
        aggregate_seq=number("aggregate_seq"),
        aggregate_epoch=text("aggregate_epoch"),
        outbox_id=number("outbox_id"),
        replay=text("replay"),
        headers={k: str(v) for k, v in fields.items() if k not in _RELAY_FIELDS},
    )


def received_from_aio_pika(message: Any) -> Received:
    """An aio-pika ``IncomingMessage`` (the relay's headers, ``message_id`` and body; or a
    CloudEvent, by its ``ce-`` headers or its ``content_type``)."""
    return _received(dict(message.headers or {}), message.body, message.message_id, message.content_type)


def received_from_kafka(record: Any) -> Received:
    """An aiokafka ``ConsumerRecord`` (the relay's fields as headers, or a CloudEvent's as
    ``ce_`` headers; the key is the aggregate id)."""
    fields = dict(record.headers or ())
    return _received(fields, record.value or b"")


def received_from_nats(message: Any) -> Received:
    """A nats-py JetStream ``Msg`` (the relay's fields as headers, or a CloudEvent's as
    ``ce-`` headers; the event id also as ``Nats-Msg-Id``)."""
    headers = dict(message.headers or {})
    # The server's own headers (Nats-Msg-Id, Nats-Expected-*) are not the producer's.
    fields = {name: value for name, value in headers.items() if not name.startswith("Nats-")}
    return _received(fields, message.data, headers.get("Nats-Msg-Id"))


def _attribute_value(attribute: Mapping[str, Any]) -> str:
    if "StringValue" in attribute:
        return str(attribute["StringValue"])
    if "Value" in attribute:  # an SNS notification's own MessageAttributes
        return str(attribute["Value"])
    if "BinaryValue" in attribute:
        value = attribute["BinaryValue"]
        return value.decode() if isinstance(value, bytes) else base64.b64decode(value).decode()
    raise ValueError(f"message attribute without a value: {sorted(attribute)}")


def received_from_sqs(message: Mapping[str, Any]) -> Received:
    """One message of boto3's ``receive_message(..., MessageAttributeNames=["All"])``
    answer, sent to SQS by the relay (or by SNS with raw message delivery); a structured
    CloudEvent (``--envelope cloudevents-json``) by its ``content-type`` attribute."""
    attributes = message.get("MessageAttributes") or {}
    fields = {name: _attribute_value(a) for name, a in attributes.items()}
    return _received(fields, str(message["Body"]).encode())


def received_from_sns(message: Mapping[str, Any]) -> Received:
    """An SNS notification as a subscribed SQS queue receives it: with raw message delivery
    the same as :func:`received_from_sqs`; without, the body is SNS's JSON envelope, whose
    ``Message`` is the event and whose ``MessageAttributes`` the relay's fields."""
    body = str(message["Body"])
    try:
        envelope = json.loads(body)
    except ValueError:
        envelope = None
    if isinstance(envelope, dict) and envelope.get("Type") == "Notification" and "Message" in envelope:
        attributes = envelope.get("MessageAttributes") or {}
        fields = {name: _attribute_value(a) for name, a in attributes.items()}
        return _received(fields, str(envelope["Message"]).encode())
    return received_from_sqs(message)


@dataclass(frozen=True, slots=True)
class _Claim:
    """Who recorded the last receipt on a connection, and in which of its transactions
    (that transaction's start, ``now()``)."""

    thread: int
    task: weakref.ref[asyncio.Task[Any]] | None
    began: datetime

    def by(self, thread: int, task: asyncio.Task[Any] | None) -> bool:
        return self.thread == thread and (self.task() if self.task else None) is task


# Per driver connection, weakly: a connection's claim goes with it.
_claims: weakref.WeakKeyDictionary[Any, _Claim] = weakref.WeakKeyDictionary()
_claims_lock = threading.Lock()


def _caller() -> tuple[int, asyncio.Task[Any] | None]:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return threading.get_ident(), task


def _driver(conn: Any) -> Any:
    """The DB-API connection under ``conn`` where it can be reached without a query (the
    key claims are kept by), else ``conn`` itself."""
    if isinstance(conn, psycopg.Cursor | psycopg.AsyncCursor):
        return conn.connection
    if type(conn).__module__.startswith("sqlalchemy"):
        try:
            from sqlalchemy.orm import Session

            connection = conn.connection() if isinstance(conn, Session) else conn
            sync = getattr(connection, "sync_connection", connection)  # an AsyncConnection's
            return sync.connection.driver_connection
        except Exception:  # not started, or a shape of a later release: no key of its own
            return conn
    return conn


async def _driver_async(conn: Any) -> Any:
    if type(conn).__module__.startswith("sqlalchemy"):
        from sqlalchemy.ext.asyncio import AsyncSession

        if isinstance(conn, AsyncSession):
            conn = await conn.connection()
    return _driver(conn)


def _foreign(key: Any) -> datetime | None:
    """Refuse a connection another task is running a statement on; else the start of the
    transaction in which another task recorded the last receipt on it, if one did (the
    receive statement refuses to record in that one)."""
    if isinstance(key, psycopg.Connection | psycopg.AsyncConnection) and key.lock.locked():
        raise ConnectionShared(
            "the connection is running another statement (another task's or thread's) at the same time:"
            " give each message its own connection, from a pool"
        )
    with _claims_lock:
        claim = _claims.get(key)
    if claim is None or claim.by(*_caller()):
        return None
    return claim.began


def _claim(key: Any, began: datetime) -> None:
    thread, task = _caller()
    try:
        with _claims_lock:
            _claims[key] = _Claim(thread, weakref.ref(task) if task else None, began)
    except TypeError:  # an object that takes no weak reference: nothing to guard with
        pass


class Inbox:
    """Exactly-once application of received events, in the consumer's own PostgreSQL.

    :param table: the inbox table (its aggregates are kept in ``<table>_aggregates``).
    :param schema: its schema.
    :param accept_first_unseen: for an ordered aggregate the inbox has never seen, take
        whatever number comes first instead of waiting for its epoch's first number (set it
        when a consumer starts on a stream that is already running).
    """

    def __init__(self, table: str = "inbox", schema: str = "public", *, accept_first_unseen: bool = False) -> None:
        statements = InboxStatements.of(OutboxNames(schema=schema, table=table))
        self.accept_first_unseen = accept_first_unseen
        self._create, self._receive, self._prune = statements.create, statements.receive, statements.prune

    def migrate(self, conn: Any) -> None:
        """Create the inbox's tables and function where absent (run it again after an
        upgrade: the function is replaced). In ``conn``'s transaction; commit it."""
        sync_runner(conn)(self._create, {})

    async def migrate_async(self, conn: Any) -> None:
        """:meth:`migrate` for asyncio connections."""
        await async_runner(conn)(self._create, {})

    def _params(self, received: Received, foreign: datetime | None) -> dict[str, Any]:
        return {
            "event_id": str(received.event_id),
            "aggregate_id": received.aggregate_id,
            "seq": received.aggregate_seq,
            "epoch": received.aggregate_epoch,
            "first_unseen": self.accept_first_unseen,
            "foreign": foreign,
        }

    def _outcome(self, received: Received, key: Any, row: tuple[Any, ...]) -> bool:
        answer, began = row
        if answer is None:
            raise ConnectionShared(
                f"event {received.event_id}: this transaction already holds another task's (or thread's) receipt;"
                " nothing was recorded: give each message its own connection and transaction, from a pool"
            )
        _claim(key, began)
        outcome, expected = answer
        if outcome == "gap":
            raise OutOfOrder(received, int(expected))
        return bool(outcome == "new")

    def receive(self, conn: Any, received: Received) -> bool:
        """Record ``received`` in ``conn``'s transaction: True when it is new (apply its
        effect in the same transaction), False for a duplicate; :class:`OutOfOrder` when an
        earlier event of its aggregate has not been applied (nothing recorded).

        :class:`ConnectionShared` (nothing recorded) when another thread or task is running
        a statement on the connection, or has recorded a receipt in the same transaction:
        one transaction is one message's (or one batch's, in one task)."""
        run = sync_runner(conn)
        key = _driver(conn)
        row = first(run(self._receive, self._params(received, _foreign(key))))
        return self._outcome(received, key, row)

    async def receive_async(self, conn: Any, received: Received) -> bool:
        """:meth:`receive` for asyncio connections."""
        run = async_runner(conn)
        key = await _driver_async(conn)
        row = first(await run(self._receive, self._params(received, _foreign(key))))
        return self._outcome(received, key, row)

    def prune(self, conn: Any, older_than: timedelta, *, limit: int = 10_000) -> int:
        """Forget at most ``limit`` event ids received more than ``older_than`` ago (ordered
        aggregates keep their numbers); how many. Keep ids longer than a redelivery can
        take: an unordered event redelivered after its id is forgotten is applied again."""
        before = datetime.now(UTC) - older_than
        rows = sync_runner(conn)(self._prune + " RETURNING 1", {"before": before, "limit": limit})
        return len(rows)
