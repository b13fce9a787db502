"""Careless mistakes get what the CLI already gives (issue 38 item 14): one line naming the
fix, a did-you-mean for a misspelt name, refusal of a setting that belongs to another
destination, a warning for a RELAY_* variable nothing reads, a Unix socket described as
one, and install instructions that work where the package index lacks the project."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from relay import ConfigError, Event, Outbox, to_json
from relay.sqlnames import OutboxNames
from tests.conftest import Db
from tests.helpers import sqlalchemy_url

ROOT = Path(__file__).resolve().parent.parent
# A database nobody answers for: a command that gets past its checks fails fast on it.
NOWHERE = "postgresql://relay@127.0.0.1:1/orders"


# ---- Outbox.add on a database that was never migrated


def test_outbox_add_on_an_unmigrated_database_says_to_run_migrate(scratch_dsn: str) -> None:
    """Before: a bare psycopg.errors.UndefinedTable ("relation "public.outbox" does not exist")."""
    with psycopg.connect(scratch_dsn) as conn:
        with pytest.raises(ConfigError) as raised:
            Outbox().add(conn, Event("order", "A", "OrderPlaced", {}))
        conn.rollback()
        with pytest.raises(ConfigError, match=r"^outbox sales\.events does not exist"):
            Outbox("events", "sales").add_many(conn, [Event("order", "A", "E", {}), Event("order", "A", "E", {})])
    line = str(raised.value)
    assert line == (
        "outbox public.outbox does not exist in this database: run `relay migrate`"
        " (with --schema and --table as given to Outbox) first"
    )
    assert isinstance(raised.value.__cause__, psycopg.errors.UndefinedTable)


async def test_the_same_line_from_asyncio_and_sqlalchemy(scratch_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(scratch_dsn) as conn:
        with pytest.raises(ConfigError, match="run `relay migrate`"):
            await Outbox().add_async(conn, Event("order", "A", "OrderPlaced", {}))
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(sqlalchemy_url(scratch_dsn))
    try:
        # SQLAlchemy wraps the driver's error in its own ProgrammingError (``orig``).
        with Session(engine) as session, pytest.raises(ConfigError, match="run `relay migrate`"):
            Outbox().add(session, Event("order", "A", "OrderPlaced", {}))
    finally:
        engine.dispose()


# ---- payloads: the path to what cannot be encoded, and no naive datetime


class Money:
    def __init__(self, amount: str) -> None:
        self.amount = decimal.Decimal(amount)


@dataclasses.dataclass
class Line:
    sku: str
    price: Any


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        ({"lines": [Line("x", Money("1.10"))]}, TypeError, "payload['lines'][0].price: cannot encode Money as JSON"),
        ({"total": Money("2")}, TypeError, "payload['total']: cannot encode Money as JSON"),
        ([{"a": 1}, {"b": {1.5, 2.5}}], TypeError, "payload[1]['b']: cannot encode set as JSON"),
        ({"ok": 1, "x": [0.5, float("nan")]}, ValueError, "payload['x'][1]: Out of range float values"),
        ({"by": {(1, 2): "pair"}}, TypeError, "payload['by'], the key (1, 2): keys must be str"),
        (Money("3"), TypeError, "payload: cannot encode Money as JSON"),
    ],
)
def test_an_encoding_error_names_the_path_to_the_value(payload: Any, error: type[Exception], message: str) -> None:
    """Before: ``cannot encode Money as JSON`` with no hint of which of a payload's values it was."""
    with pytest.raises(error) as raised:
        to_json(payload)
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_circular_or_too_deep_payload_gets_one_line() -> None:
    loop: list[Any] = []
    loop.append({"again": loop})
    with pytest.raises(ValueError, match=r"^payload\[0\]\['again'\] \(a circular reference\): Circular"):
        to_json(loop)
    deep: dict[str, Any] = {}
    for _ in range(100_000):
        deep = {"d": deep}
    with pytest.raises(ValueError, match=r"^payload: nested too deeply to encode as JSON$"):
        to_json(deep)


def test_a_naive_datetime_is_refused_and_an_aware_one_kept() -> None:
    """Before: ``datetime(2026, 12, 3, 10, 0)`` was stored as "2026-12-03T10:00:00", which a
    consumer reads as UTC or as its own local time."""
    naive = dt.datetime(2026, 12, 3, 10, 0)
    with pytest.raises(TypeError, match=r"^payload\['placed'\]: a datetime without a time zone names no instant"):
        to_json({"placed": naive})

    @dataclasses.dataclass
    class Placed:
        at: dt.datetime

    with pytest.raises(TypeError, match=r"^payload\.at: a datetime without a time zone"):
        to_json(Placed(naive))
    aware = naive.replace(tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert to_json({"placed": aware, "day": naive.date(), "opens": dt.time(9, 0)}) == (
        '{"placed":"2026-12-03T10:00:00+01:00","day":"2026-12-03","opens":"09:00:00"}'
    )


def test_nothing_is_written_when_a_payload_is_refused(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    with psycopg.connect(producer_dsn) as conn:
        with pytest.raises(TypeError, match=r"^payload\['at'\]: a datetime without a time zone"):
            Outbox(names.table, names.schema).add(conn, Event("order", "A", "E", {"at": dt.datetime(2026, 1, 1)}))
        conn.commit()
    assert db.rows() == []
