"""relay.Outbox, the producers' API, in every flavour it supports: psycopg sync and async,
SQLAlchemy Session, Connection, AsyncSession and AsyncConnection, Django's connection.
Each writes in the caller's transaction (rolled back with it), refuses autocommit, and
writes what the relay then delivers (read back from the table as the producer role)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from pydantic import BaseModel

from relay import Event, NotInTransaction, Outbox, to_json
from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.helpers import sqlalchemy_url


def rows(db: Db) -> list[dict[str, Any]]:
    return [
        {k: r[k] for k in ("aggregate_type", "aggregate_id", "event_type", "payload", "headers", "event_id")}
        for r in db.rows()
    ]


def outbox_for(names: OutboxNames) -> Outbox:
    return Outbox(names.table, names.schema)


def test_psycopg_sync_commits_and_rolls_back_with_the_caller(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    outbox = outbox_for(names)
    with psycopg.connect(producer_dsn) as conn:
        event_id = outbox.add(conn, Event("order", "A", "OrderPlaced", {"n": 1}, headers={"tenant": "t1"}))
        conn.rollback()
        assert rows(db) == []
        event_id = outbox.add(conn, Event("order", "A", "OrderPlaced", {"n": 1}, headers={"tenant": "t1"}))
        conn.commit()
    [row] = rows(db)
    assert row == {
        "aggregate_type": "order",
        "aggregate_id": "A",
        "event_type": "OrderPlaced",
        "payload": {"n": 1},
        "headers": {"tenant": "t1"},
        "event_id": event_id,
    }


def test_psycopg_autocommit_is_refused_and_a_transaction_block_is_not(
    db: Db, names: OutboxNames, producer_dsn: str
) -> None:
    outbox = outbox_for(names)
    with psycopg.connect(producer_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransaction, match="autocommit with no transaction open"):
            outbox.add(conn, Event("order", "A", "OrderPlaced", {}))
        assert rows(db) == []
        with conn.transaction():
            outbox.add(conn, Event("order", "A", "OrderPlaced", {}))
    assert len(rows(db)) == 1


async def test_psycopg_async_and_the_batch_keeps_its_order(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    outbox = outbox_for(names)
    events = [Event("order", "A", "OrderLine", {"line": i}) for i in range(50)]
    async with await psycopg.AsyncConnection.connect(producer_dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransaction):
            await outbox.add_async(conn, events[0])
        async with conn.transaction():
            ids = await outbox.add_many_async(conn, events)
    assert ids == [e.event_id for e in events]
    got = rows(db)
    assert [r["payload"]["line"] for r in got] == list(range(50))  # ids (commit order within it) as given
    assert [r["event_id"] for r in got] == ids


def test_sqlalchemy_session_and_connection(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(sqlalchemy_url(producer_dsn))
    outbox = outbox_for(names)
    try:
        with Session(engine) as session:
            outbox.add(session, Event("order", "S", "OrderPlaced", {"via": "session"}))
            session.rollback()
            with session.begin():
                outbox.add(session, Event("order", "S", "OrderPlaced", {"via": "session"}))
        with engine.begin() as conn:
            outbox.add_many(conn, [Event("order", "C", "OrderPlaced", {"via": "connection", "i": i}) for i in range(3)])
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn, pytest.raises(NotInTransaction):
            outbox.add(conn, Event("order", "X", "OrderPlaced", {}))
    finally:
        engine.dispose()
    assert [(r["aggregate_id"], r["payload"]) for r in rows(db)] == [
        ("S", {"via": "session"}),
        ("C", {"via": "connection", "i": 0}),
        ("C", {"via": "connection", "i": 1}),
        ("C", {"via": "connection", "i": 2}),
    ]


async def test_sqlalchemy_async_session_and_connection(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    pytest.importorskip("sqlalchemy")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(sqlalchemy_url(producer_dsn))
    outbox = outbox_for(names)
    try:
        async with AsyncSession(engine) as session, session.begin():
            await outbox.add_async(session, Event("order", "S", "OrderPlaced", {"via": "async session"}))
        async with engine.begin() as conn:
            await outbox.add_async(conn, Event("order", "C", "OrderPlaced", {"via": "async connection"}))
        async with engine.connect() as conn:
            auto = await conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(NotInTransaction):
                await outbox.add_async(auto, Event("order", "X", "OrderPlaced", {}))
        with pytest.raises(TypeError, match="asynchronous"):
            async with AsyncSession(engine) as session:
                outbox.add(session, Event("order", "X", "OrderPlaced", {}))
    finally:
        await engine.dispose()
    assert [r["payload"]["via"] for r in rows(db)] == ["async session", "async connection"]


@pytest.fixture
def django_connection(producer_dsn: str) -> Iterator[Any]:
    pytest.importorskip("django")
    import django
    from django.conf import settings

    d = conninfo_to_dict(producer_dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": d["dbname"],
        "USER": d["user"],
        "HOST": d.get("host", "127.0.0.1"),
        "PORT": d.get("port", "5432"),
    }
    if not settings.configured:  # once per process; the producer role is the session's
        settings.configure(DATABASES={"default": database}, USE_TZ=True)
        django.setup()
    from django.db import connections

    connection = connections["default"]
    assert connection.settings_dict["USER"] == d["user"]
    yield connection
    connection.close()


def test_django_inside_atomic_only(db: Db, names: OutboxNames, django_connection: Any) -> None:
    from django.db import transaction

    outbox = outbox_for(names)
    with pytest.raises(NotInTransaction):
        outbox.add(django_connection, Event("order", "D", "OrderPlaced", {}))

    def rolled_back() -> None:
        with transaction.atomic(using=django_connection.alias):
            outbox.add(django_connection, Event("order", "D", "OrderPlaced", {"n": 0}))
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError, match="rolled back"):
        rolled_back()
    with transaction.atomic(using=django_connection.alias):
        outbox.add(django_connection, Event("order", "D", "OrderPlaced", {"n": 1}))
    assert [r["payload"] for r in rows(db)] == [{"n": 1}]


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal


class Order(BaseModel):
    id: uuid.UUID
    placed: dt.datetime


def test_payload_encoding_is_documented_and_refuses_what_jsonb_cannot_hold() -> None:
    order_id = uuid.UUID("12345678-1234-5678-1234-567812345678")
    placed = dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.UTC)
    assert json.loads(to_json({"line": Line("x", decimal.Decimal("1.10")), "colour": Colour.RED})) == {
        "line": {"sku": "x", "price": "1.10"},
        "colour": "red",
    }
    assert json.loads(to_json(Order(id=order_id, placed=placed))) == {
        "id": str(order_id),
        "placed": "2026-12-03T10:00:00Z",
    }
    with pytest.raises(ValueError, match="not JSON compliant"):
        to_json({"x": float("nan")})
    with pytest.raises(TypeError, match="cannot encode set"):
        to_json({1, 2})


def test_headers_the_relay_would_refuse_fail_in_the_producer(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    outbox = outbox_for(names)
    with psycopg.connect(producer_dsn) as conn:
        with pytest.raises(ValueError, match="one of the relay's own"):
            outbox.add(conn, Event("order", "A", "E", {}, headers={"outbox_id": "1"}))
        with pytest.raises(ValueError, match="must be a string"):
            outbox.add(conn, Event("order", "A", "E", {}, headers={"n": 1}))  # type: ignore[dict-item]
        conn.rollback()
    assert rows(db) == []


def test_trace_context_of_the_current_span_goes_into_the_headers(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    outbox = outbox_for(names)
    with psycopg.connect(producer_dsn) as conn:
        with tracer.start_as_current_span("place order") as span:
            outbox.add(conn, Event("order", "A", "E", {}, headers={"tenant": "t"}))
            context = span.get_span_context()
        outbox.add(conn, Event("order", "B", "E", {}))  # no span: no trace headers
        conn.commit()
    first, second = rows(db)
    assert first["headers"].keys() == {"tenant", "traceparent"}
    assert first["headers"]["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
    assert second["headers"] is None


def test_names_go_through_identifiers_only() -> None:
    with pytest.raises(Exception, match="invalid table name"):
        Outbox('outbox"; DROP TABLE x; --')
