"""How the database layer runs a named statement and reads its rows: one place, so each
module of it names its statements and builds its row types, and nothing else."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import psycopg
from psycopg.rows import dict_row

from relay.db.names import OutboxNames
from relay.db.statements import statement
from relay.dsn import mask

Conn = psycopg.AsyncConnection[Any]
Row = dict[str, Any]
T = TypeVar("T")


async def fetch_all(conn: Conn, names: OutboxNames, name: str, params: Mapping[str, Any] | None = None) -> list[Row]:
    """Every row of the named statement ``name`` run for ``names``, as dicts."""
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(statement(names, name), params)
    return await cur.fetchall()


async def fetch_one(conn: Conn, names: OutboxNames, name: str, params: Mapping[str, Any] | None = None) -> Row:
    """The row of a statement that always returns exactly one (aggregates, SELECT without FROM)."""
    rows = await fetch_all(conn, names, name, params)
    if not rows:
        raise RuntimeError(f"{name} returned no row")
    return rows[0]


def masked(error: str | None) -> str | None:
    # Rows written before last_error was masked on the way in are masked on the way out.
    return mask(error) if error else error


def masked_row(cls: type[T], r: Row) -> T:
    """``cls`` (a dataclass whose fields are columns of ``r``) from row ``r``, its
    ``last_error`` masked."""
    values = {f.name: r[f.name] for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if "last_error" in values:
        values["last_error"] = masked(values["last_error"])
    return cls(**values)
