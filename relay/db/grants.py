"""The privileges of producer and relay roles (``sql/grants.sql``): granted by `relay
migrate --grant-producer/--grant-relay`, printed for a DBA by `relay grants`.

Roles are identifiers like the outbox's names: they reach SQL only through
:class:`psycopg.sql.Identifier`, never as text.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql

from relay.db.names import IDENTIFIER_MAX, OutboxNames
from relay.db.statements import named_grants
from relay.errors import ConfigError, shown

# The advisory lock key that serializes grants within one database (see grant()).
GRANTS_LOCK = "outbox-relay:grants"

Kind = Literal["producer", "relay"]
KINDS: tuple[Kind, ...] = ("producer", "relay")


@dataclass(frozen=True)
class Grantee:
    """One role and what it is to be granted."""

    kind: Kind
    role: str


def check_role_name(role: str, option: str) -> str:
    """``role`` if PostgreSQL could name a role so; one line otherwise."""
    if not role:
        raise ConfigError(f"invalid {option}: empty role name")
    if len(role.encode("utf-8")) > IDENTIFIER_MAX:
        raise ConfigError(f"invalid {option} {shown(role)}: longer than {IDENTIFIER_MAX} bytes")
    if any(ord(c) < 32 or ord(c) == 127 for c in role):
        raise ConfigError(f"invalid {option} {shown(role)}: control characters in a role name")
    return role


def grantees(producers: Sequence[str], relays: Sequence[str]) -> list[Grantee]:
    """The roles of the repeatable options, checked, in the order given."""
    found = [Grantee("producer", check_role_name(r, "--grant-producer")) for r in producers]
    found += [Grantee("relay", check_role_name(r, "--grant-relay")) for r in relays]
    return found


def statements(names: OutboxNames, grantee: Grantee, database: str) -> list[sql.Composed]:
    """Every GRANT for ``grantee`` on the outbox ``names``, in ``database``."""
    prefix = f"grant_{grantee.kind}_"
    found = []
    for name, text in named_grants().items():
        if not name.startswith(prefix):
            continue
        keys = {field for _, field, _, _ in string.Formatter().parse(text) if field}
        values: dict[str, sql.Composable] = {}
        for key in keys:
            if key == "role":
                values[key] = sql.Identifier(grantee.role)
            elif key == "database":
                values[key] = sql.Identifier(database)
            else:
                values[key] = names.identifier(key)
        found.append(sql.SQL(text).format(**values))
    return found


async def database_for(conn: psycopg.AsyncConnection[Any], chosen: Sequence[Grantee]) -> str:
    """The current database's name, once every role in ``chosen`` is known to exist."""
    database = ""
    for grantee in chosen:
        cur = await conn.execute(named_grants()["grants_role_exists"], {"role": grantee.role})
        row = await cur.fetchone()
        assert row is not None
        found, database = row
        if not found:
            option = f"--grant-{grantee.kind}"
            raise ConfigError(f"invalid {option} {shown(grantee.role)}: no such role in this cluster")
    if not database:
        cur = await conn.execute("SELECT current_database()::text")
        row = await cur.fetchone()
        assert row is not None
        database = row[0]
    return database


async def grant(conn: psycopg.AsyncConnection[Any], names: OutboxNames, chosen: Sequence[Grantee]) -> None:
    """Grant every role in ``chosen`` its privileges on ``names``, in one transaction.

    Grants on one database wait for each other (an advisory lock for the transaction):
    each rewrites the database's privileges, and PostgreSQL fails concurrent rewrites of
    that catalog row with "tuple concurrently updated", as when two services' deploys run
    `relay migrate --grant-relay` at once."""
    database = await database_for(conn, chosen)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (GRANTS_LOCK,))
        for grantee in chosen:
            for statement in statements(names, grantee, database):
                await conn.execute(statement)


async def script(conn: psycopg.AsyncConnection[Any], names: OutboxNames, chosen: Sequence[Grantee]) -> str:
    """The SQL :func:`grant` runs, as text for a DBA (identifiers quoted by ``conn``)."""
    database = await database_for(conn, chosen)
    lines = ["BEGIN;"]
    for grantee in chosen:
        lines.append(f"-- {grantee.kind} role")
        lines += [f"{statement.as_string(conn)};" for statement in statements(names, grantee, database)]
    lines.append("COMMIT;")
    return "\n".join(lines)
