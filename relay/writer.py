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

Payloads become JSON (:func:`to_json`). Headers are the producer headers of docs/concepts/producers.md
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

from psycopg import sql

from relay._transactions import async_runner, sync_runner
from relay.message import producer_headers
from relay.sqlnames import OutboxNames

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
    if isinstance(value, dt.datetime | dt.date | dt.time):
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
    ``model_dump(mode="json")``; datetime, date and time in ISO 8601; UUID and Decimal as
    strings; enums by their value. Anything else raises TypeError, as do NaN and infinity
    (PostgreSQL's jsonb refuses them)."""
    return _ENCODER.encode(payload)


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


_INSERT = """
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, headers, event_id)
SELECT e.aggregate_type, e.aggregate_id, e.event_type, e.payload, e.headers, e.event_id
  FROM unnest(CAST(%(aggregate_types)s AS text[]), CAST(%(aggregate_ids)s AS text[]),
              CAST(%(event_types)s AS text[]), CAST(%(payloads)s AS jsonb[]),
              CAST(%(headers)s AS jsonb[]), CAST(%(event_ids)s AS uuid[]))
       WITH ORDINALITY AS e(aggregate_type, aggregate_id, event_type, payload, headers, event_id, n)
 ORDER BY e.n
"""


_INSERT_ONE = """
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, headers, event_id)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, CAST(%(payload)s AS jsonb),
        CAST(%(headers)s AS jsonb), CAST(%(event_id)s AS uuid))
"""


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
        table_id = sql.Identifier(schema, table)
        self._insert = sql.SQL(_INSERT).format(outbox=table_id).as_string(None)
        self._insert_one = sql.SQL(_INSERT_ONE).format(outbox=table_id).as_string(None)

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
        """Add ``events`` in one statement, in the order given; their ids."""
        run = sync_runner(conn)
        statement, params, ids = self._statement(events)
        if ids:
            run(statement, params)
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
            await run(statement, params)
        return ids
