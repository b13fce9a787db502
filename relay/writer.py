"""Writing events into the outbox from application code, in the application's transaction.

::

    from relay import Event, Outbox

    outbox = Outbox()                       # the table relay migrate made: public.outbox
    with conn.transaction():                # psycopg; or a SQLAlchemy session, or Django's atomic
        conn.execute("UPDATE orders SET status = 'paid' WHERE id = %s", (order_id,))
        outbox.add(conn, Event("order", str(order_id), "OrderPaid", {"order_id": order_id}))

:meth:`Outbox.add` is one INSERT, :meth:`Outbox.add_many` one INSERT for any number of
events (in the order given, which is their order in their aggregate's sequence when the
type is ordered); ``add_async``/``add_many_async`` are the same for asyncio connections.
Each refuses a connection outside a transaction (:class:`relay.NotInTransaction`) and
returns the events' ids.

Payloads become JSON (:func:`to_json`); a value it cannot encode (a naive ``datetime``
among them) is refused with the path to it. Headers are the producer headers of docs/concepts/producers.md
("Producer headers"): names and values are checked when written, as the relay checks them
when it claims, so a mistake fails in the producer, not later as a dead message. When
OpenTelemetry is installed and a span is current, its W3C trace context (``traceparent``,
``tracestate``) is added to the headers, so the relay's publish span and the consumer
continue the producer's trace.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relay._transactions import async_runner, sync_runner
from relay.db.names import OutboxNames
from relay.db.writer import WriterStatements
from relay.errors import ConfigError, shown
from relay.message import producer_headers

__all__ = ["Event", "Outbox", "to_json"]


@dataclass(frozen=True, slots=True)
class Event:
    """One event for the outbox.

    :param aggregate_type: what kind of thing changed (``"order"``); part of the default
        routing key.
    :param aggregate_id: which one; ordered event types are delivered in commit order per
        ``aggregate_id`` (at most 2,048 bytes for those).
    :param event_type: what happened (``"OrderPaid"``); the ordering map and routes match it.
    :param payload: the body, anything :func:`to_json` encodes.
    :param headers: producer headers, string to string (sent as AMQP headers or SQS/SNS
        message attributes).
    :param event_id: the event's identity, sent downstream as ``event_id`` (AMQP
        ``message_id``); a new random UUID unless given (give one to make a retried request
        write the same event id).
    """

    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Any
    headers: Mapping[str, str] | None = None
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)


def _default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    dump = getattr(value, "model_dump", None)  # pydantic 2
    if callable(dump):
        return dump(mode="json")
    if isinstance(value, dt.datetime):
        if value.utcoffset() is None:
            # Written without its zone, it would be read back as UTC by one consumer and as
            # local time by another: not the instant the producer meant.
            raise TypeError(
                "a datetime without a time zone names no instant: give it one"
                " (datetime.now(timezone.utc), or .replace(tzinfo=...) for a local time)"
            )
        return value.isoformat()
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, decimal.Decimal):
        # As a string: a JSON number would lose the digits a float cannot hold.
        return str(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


# One encoder for every call: json.dumps with options builds a new one each time.
_ENCODER = json.JSONEncoder(default=_default, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def to_json(payload: Any) -> str:
    """The payload as JSON text: dicts, lists, strings, numbers, booleans and None as
    themselves; dataclasses as objects of their fields; pydantic models by
    ``model_dump(mode="json")``; datetime (with its time zone), date and time in ISO 8601;
    UUID and Decimal as strings; enums by their value. Anything else raises TypeError, as
    does a datetime without a time zone, and NaN and infinity raise ValueError (PostgreSQL's
    jsonb refuses them); the message starts with the path to the value
    (``payload['lines'][0].price: cannot encode Money as JSON``)."""
    try:
        return _ENCODER.encode(payload)
    except RecursionError:
        raise ValueError("payload: nested too deeply to encode as JSON") from None
    except (TypeError, ValueError) as exc:
        error = TypeError if isinstance(exc, TypeError) else ValueError
        raise error(f"{_where(payload)}: {exc}") from None


# Path to a value that cannot be encoded: what a message shows of it at most.
MAX_PATH_CHARS = 200
_KEY_TYPES = (str, int, float, bool, type(None))


def _where(payload: Any) -> str:
    """The path from ``payload`` to the value the encoder refused (``payload['lines'][0].price``).
    Only called once encoding failed: it walks down the one branch that fails, encoding the
    children of each node until one does not encode, without recursion (however deep the
    payload) and stopping at a circular reference."""
    path = ["payload"]
    node = payload
    on_path: set[int] = set()
    while True:
        if id(node) in on_path:
            path.append(" (a circular reference)")
            break
        on_path.add(id(node))
        children = _children(node)
        if isinstance(children, str):  # a dict key of a type JSON has no name for
            path.append(children)
            break
        culprit = next(((step, child) for step, child in children if not _encodes(child)), None)
        if culprit is None:
            break  # the node itself (a leaf, or what it was converted to)
        path.append(culprit[0])
        node = culprit[1]
    text = "".join(path)
    if len(text) > MAX_PATH_CHARS:
        text = f"{text[: MAX_PATH_CHARS // 4]}...{text[-MAX_PATH_CHARS // 2 :]}"
    return text


def _children(node: Any) -> list[tuple[str, Any]] | str:
    """The values inside ``node`` as the encoder reaches them, each with its step of the
    path; or the step naming a key the encoder refuses."""
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, _KEY_TYPES):
                return f", the key {shown(key)}"
        return [(f"[{shown(key)}]", value) for key, value in node.items()]
    if isinstance(node, list | tuple):
        return [(f"[{i}]", value) for i, value in enumerate(node)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f".{f.name}", getattr(node, f.name)) for f in dataclasses.fields(node)]
    return []  # a pydantic model (its own serializer decides), or a leaf


def _encodes(value: Any) -> bool:
    try:
        _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _trace_headers() -> dict[str, str]:
    """The current OpenTelemetry span's W3C context, when OpenTelemetry is installed and a
    span is recording or sampled; nothing otherwise."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return {}
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")}


# The batch statement's parameter (an array) for each of the single-row statement's.
_ONE = {
    "aggregate_types": "aggregate_type",
    "aggregate_ids": "aggregate_id",
    "event_types": "event_type",
    "payloads": "payload",
    "headers": "headers",
    "event_ids": "event_id",
}


class Outbox:
    """Adds events to one outbox table in the caller's transaction.

    :param table: the outbox table (``relay migrate --table``).
    :param schema: its schema (``relay migrate --schema``).
    :param trace_context: add the current OpenTelemetry span's ``traceparent`` and
        ``tracestate`` to each event's headers (a header the event sets itself wins).

    The producer role needs only what ``relay grants --grant-producer`` gives: INSERT on the
    producer columns. Nothing is read back.
    """

    def __init__(self, table: str = "outbox", schema: str = "public", *, trace_context: bool = True) -> None:
        self.names = OutboxNames(schema=schema, table=table)
        self.trace_context = trace_context
        statements = WriterStatements.of(self.names)
        self._insert, self._insert_one = statements.insert, statements.insert_one

    def _row(self, event: Event, trace: Mapping[str, str]) -> dict[str, Any]:
        """One event as the single-row statement's parameters, checked."""
        if not isinstance(event, Event):
            raise TypeError(f"expected relay.Event, not {type(event).__name__}")
        headers = {**trace, **event.headers} if event.headers else trace
        if headers:
            producer_headers(dict(headers))  # ValueError naming the header the relay would refuse
        return {
            "aggregate_type": event.aggregate_type,
            "aggregate_id": event.aggregate_id,
            "event_type": event.event_type,
            "payload": to_json(event.payload),
            "headers": json.dumps(headers, ensure_ascii=False) if headers else None,
            "event_id": str(event.event_id),
        }

    def _statement(self, events: Iterable[Event]) -> tuple[str, dict[str, Any], list[uuid.UUID]]:
        """The INSERT for ``events``: VALUES for one (the cheapest for the common case),
        unnest() of arrays for several (one statement whatever their number)."""
        trace = self._trace()
        listed = list(events)
        rows = [self._row(event, trace) for event in listed]
        ids = [event.event_id for event in listed]
        if len(rows) == 1:
            return self._insert_one, rows[0], ids
        return self._insert, {many: [row[one] for row in rows] for many, one in _ONE.items()}, ids

    def _trace(self) -> dict[str, str]:
        return _trace_headers() if self.trace_context else {}

    def add(self, conn: Any, event: Event) -> uuid.UUID:
        """Add ``event`` in ``conn``'s transaction (psycopg Connection, SQLAlchemy Session or
        Connection, Django connection); its id."""
        return self.add_many(conn, [event])[0]

    def add_many(self, conn: Any, events: Iterable[Event]) -> list[uuid.UUID]:
        """Add ``events`` in one statement, in the order given; their ids. An outbox
        that does not exist raises :class:`relay.ConfigError` saying to run `relay migrate`."""
        run = sync_runner(conn)
        statement, params, ids = self._statement(events)
        if ids:
            try:
                run(statement, params)
            except Exception as exc:
                self._explain(exc)
                raise
        return ids

    async def add_async(self, conn: Any, event: Event) -> uuid.UUID:
        """:meth:`add` for psycopg's AsyncConnection and SQLAlchemy's AsyncSession or
        AsyncConnection."""
        return (await self.add_many_async(conn, [event]))[0]

    async def add_many_async(self, conn: Any, events: Iterable[Event]) -> list[uuid.UUID]:
        """:meth:`add_many` for asyncio connections."""
        run = async_runner(conn)
        statement, params, ids = self._statement(events)
        if ids:
            try:
                await run(statement, params)
            except Exception as exc:
                self._explain(exc)
                raise
        return ids

    def _explain(self, exc: Exception) -> None:
        """Raise a ConfigError naming the fix when ``exc`` says the outbox table is not there
        (PostgreSQL's 42P01, as psycopg, SQLAlchemy or Django raise it); else return."""
        if _missing_relation(exc):
            raise ConfigError(
                f"outbox {self.names.qualified} does not exist in this database: run `relay migrate`"
                f" (with --schema and --table as given to Outbox) first"
            ) from exc


# PostgreSQL's SQLSTATE for a table (or its schema, when the name is qualified) that does not exist.
UNDEFINED_TABLE = "42P01"


def _missing_relation(exc: BaseException) -> bool:
    """Whether ``exc`` or the driver error it wraps (SQLAlchemy's ``orig``, Django's cause)
    is PostgreSQL's undefined_table, whichever driver raised it (psycopg and asyncpg name
    it ``sqlstate``, psycopg2 ``pgcode``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if UNDEFINED_TABLE in (getattr(error, "sqlstate", None), getattr(error, "pgcode", None)):
            return True
        orig = getattr(error, "orig", None)
        todo += [orig if isinstance(orig, BaseException) else None, error.__cause__, error.__context__]
    return False
