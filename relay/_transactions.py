"""Running one statement in the caller's own transaction, whatever holds it.

relay.writer and relay.inbox take the connection (or session) the application already
uses, so that the event or the receipt commits or rolls back with the application's own
change. What they accept:

* psycopg 3: ``Connection``, ``AsyncConnection`` (or a cursor of either);
* SQLAlchemy 2: ``Session``, ``Connection``, ``AsyncSession``, ``AsyncConnection``
  (with the psycopg driver, ``postgresql+psycopg://``; psycopg2 and asyncpg are checked
  the same way);
* Django: ``django.db.connection`` (or ``connections[alias]``), inside ``transaction.atomic``.

Each refuses to run outside a transaction (an autocommit connection with no transaction
open), with :class:`NotInTransaction`: the statement would commit at once, alone, and an
event could then be sent for a change the application rolls back (or a receipt kept for
an effect that never happened).

Statements are written with ``%(name)s`` placeholders and CAST() (never ``::``, which
SQLAlchemy's ``text()`` would read as part of a parameter name); this module renders them
for the driver at hand. They are the library's own constants: no text from a caller ever
becomes SQL.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from relay.errors import ConfigError


class NotInTransaction(ConfigError):
    """The connection is in autocommit with no transaction open: nothing the call writes
    would commit with the caller's own change. Open one (``with conn.transaction():``,
    ``with session.begin():``, ``with transaction.atomic():``) or turn autocommit off."""


Params = Mapping[str, Any]
Rows = list[tuple[Any, ...]]
SyncRun = Callable[[str, Params], Rows]
AsyncRun = Callable[[str, Params], Awaitable[Rows]]

_PARAM = re.compile(r"%\((\w+)\)s")


def _refuse(what: str) -> NotInTransaction:
    return NotInTransaction(
        f"{what} is in autocommit with no transaction open: the outbox write would commit alone;"
        " run it inside the transaction that makes the change"
    )


def _check_driver(driver: Any, what: str) -> None:
    """Refuse a DB-API connection of a known driver that is outside any transaction."""
    info = getattr(driver, "info", None)
    if info is not None and hasattr(info, "transaction_status"):  # psycopg 3
        if driver.autocommit and info.transaction_status == TransactionStatus.IDLE:
            raise _refuse(what)
        return
    if hasattr(driver, "is_in_transaction"):  # asyncpg
        if not driver.is_in_transaction():
            raise _refuse(what)
        return
    if hasattr(driver, "get_transaction_status"):  # psycopg2
        if driver.autocommit and driver.get_transaction_status() == 0:  # TRANSACTION_STATUS_IDLE
            raise _refuse(what)
        return
    raise ConfigError(f"cannot tell whether {what} is inside a transaction (driver {type(driver).__name__})")


@functools.lru_cache(maxsize=64)
def _encoded(statement: str) -> bytes:
    """One of this library's statements as psycopg takes a query that is not a literal."""
    return statement.encode()


@functools.lru_cache(maxsize=64)
def _sqlalchemy_text(statement: str) -> Any:
    from sqlalchemy import text

    return text(_PARAM.sub(r":\1", statement))


def _kind(conn: Any) -> str:
    module = type(conn).__module__
    if module.startswith("psycopg"):
        return "psycopg"
    if module.startswith("sqlalchemy"):
        return "sqlalchemy"
    if module.startswith("django"):
        return "django"
    raise TypeError(
        f"expected a psycopg connection, a SQLAlchemy session or connection, or a Django connection,"
        f" not {type(conn).__module__}.{type(conn).__name__}"
    )


def sync_runner(conn: Any) -> SyncRun:
    """A function that runs one statement on ``conn`` and returns its rows, after checking
    that ``conn`` is inside a transaction."""
    kind = _kind(conn)
    if kind == "psycopg":
        connection = conn.connection if isinstance(conn, psycopg.Cursor) else conn
        if not isinstance(connection, psycopg.Connection):
            raise TypeError(f"{type(conn).__name__} is asynchronous: use the *_async method")
        _check_driver(connection, "the psycopg connection")

        def run_psycopg(statement: str, params: Params) -> Rows:
            cur = connection.execute(_encoded(statement), params)
            return cur.fetchall() if cur.description else []

        return run_psycopg
    if kind == "sqlalchemy":
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if isinstance(conn, AsyncSession | AsyncConnection):
            raise TypeError(f"{type(conn).__name__} is asynchronous: use the *_async method")
        from sqlalchemy.orm import Session

        # Session.connection() begins the session's transaction if none is (autobegin).
        connection = conn.connection() if isinstance(conn, Session) else conn
        _check_driver(connection.connection.driver_connection, "the SQLAlchemy connection")

        def run_sqlalchemy(statement: str, params: Params) -> Rows:
            result = connection.execute(_sqlalchemy_text(statement), dict(params))
            return [tuple(r) for r in result] if result.returns_rows else []

        return run_sqlalchemy
    # Django: its own wrapper, whose cursor takes %(name)s with a mapping (psycopg drivers).
    if conn.vendor != "postgresql":
        raise ConfigError(f"the outbox lives in PostgreSQL, and this Django connection is {conn.vendor}")
    if conn.get_autocommit() and not conn.in_atomic_block:
        raise _refuse("the Django connection")

    def run_django(statement: str, params: Params) -> Rows:
        with conn.cursor() as cur:
            cur.execute(statement, dict(params))
            return list(cur.fetchall()) if cur.description else []

    return run_django


def async_runner(conn: Any) -> AsyncRun:
    """:func:`sync_runner` for psycopg's AsyncConnection and SQLAlchemy's AsyncSession and
    AsyncConnection."""
    kind = _kind(conn)
    if kind == "psycopg":
        connection = conn.connection if isinstance(conn, psycopg.AsyncCursor) else conn
        if not isinstance(connection, psycopg.AsyncConnection):
            raise TypeError(f"{type(conn).__name__} is synchronous: use the method without _async")
        _check_driver(connection, "the psycopg connection")

        async def run_psycopg(statement: str, params: Params) -> Rows:
            cur = await connection.execute(_encoded(statement), params)
            return await cur.fetchall() if cur.description else []

        return run_psycopg
    if kind == "sqlalchemy":
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        if not isinstance(conn, AsyncSession | AsyncConnection):
            raise TypeError(f"{type(conn).__name__} is synchronous: use the method without _async")
        state: dict[str, Any] = {}

        async def run_sqlalchemy(statement: str, params: Params) -> Rows:
            connection = state.get("connection")
            if connection is None:
                connection = await conn.connection() if isinstance(conn, AsyncSession) else conn
                raw = await connection.get_raw_connection()
                _check_driver(raw.driver_connection, "the SQLAlchemy connection")
                state["connection"] = connection
            result = await connection.execute(_sqlalchemy_text(statement), dict(params))
            return [tuple(r) for r in result] if result.returns_rows else []

        return run_sqlalchemy
    raise TypeError("Django's connections are synchronous: use the method without _async")


def first(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The one row a statement returns."""
    if len(rows) != 1:
        raise RuntimeError(f"expected one row, got {len(rows)}")
    return rows[0]
