"""Applies the numbered migrations under ``sql/migrations`` to one outbox.

Safe to run from several processes at once: every run takes a transaction-scoped
advisory lock keyed by the outbox's name before it looks at what is applied, and
applies all missing migrations plus their bookkeeping rows in that one transaction.

What the database refuses, or would refuse (a system schema, a privilege the role lacks,
a name another object already holds), is one :class:`MigrationRefused` line naming the
outbox and what to do; since everything runs in one transaction, nothing was changed.
"""

from __future__ import annotations

import logging
import re
import string
from dataclasses import dataclass
from functools import cache
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.rows import dict_row

from relay.db.names import OutboxNames
from relay.db.partitions import Ahead, Partitioned, PartitionSpec, keep_ahead, partition_outbox
from relay.db.statements import migrations, statement
from relay.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger("relay.db.migrate")

# The schemas PostgreSQL keeps for itself: it reserves the "pg_" prefix (pg_catalog,
# pg_toast, pg_temp_N, ...), and a superuser could create tables in information_schema.
_SYSTEM_SCHEMA = re.compile(r"^(pg_.*|information_schema)$")
_SIMPLE_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_QUOTED = re.compile(r'"([^"]+)"')
_DUPLICATES = (pg_errors.DuplicateTable, pg_errors.DuplicateObject, pg_errors.DuplicateFunction)


class MigrationRefused(ConfigError):
    """The database refused the migration, or would have: nothing was changed."""


@dataclass(frozen=True)
class MigrationResult:
    applied: list[str]
    already: list[str]
    # A partitioned outbox (relay.db.partitions): what it is and the partitions kept ahead,
    # created in the same transaction; None for a plain one.
    partitioned: Partitioned | None = None
    ahead: Ahead | None = None


async def migrate(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, partitioning: PartitionSpec | None = None
) -> MigrationResult:
    """Bring the outbox ``names`` up to the newest migration; idempotent. With
    ``partitioning``, also make it partitioned by id (an empty plain outbox is converted, a
    non-empty one refused); a partitioned outbox gets its missing partitions ahead either way.

    Raises :class:`MigrationRefused` for what the database refuses (nothing is changed then)
    and :class:`relay.errors.DatabaseUnavailable` if the session fails on the way.
    """
    refuse_system_schema(names)
    try:
        return await _migrate(conn, names, partitioning)
    except (pg_errors.InsufficientPrivilege, *_DUPLICATES, pg_errors.ReadOnlySqlTransaction) as exc:
        raise await _refusal(conn, names, exc) from None
    except psycopg.OperationalError as exc:  # lost session, statement or lock timeout
        raise DatabaseUnavailable(
            f"migrating outbox {names.qualified} failed, nothing was changed: {pg_message(exc)}"
        ) from None
    except psycopg.Error as exc:
        raise MigrationRefused(f"cannot migrate outbox {names.qualified}: {pg_message(exc)}") from None


def refuse_system_schema(names: OutboxNames) -> None:
    """Refuse, before anything is sent to the database, an outbox in a schema of PostgreSQL's own."""
    if _SYSTEM_SCHEMA.match(names.schema):
        raise MigrationRefused(
            f"cannot migrate outbox {names.qualified}: {names.schema} is a system schema of PostgreSQL;"
            " choose a schema of your own with --schema (the default is public)"
        )


async def _migrate(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, partitioning: PartitionSpec | None
) -> MigrationResult:
    ledger = names.identifier("q_migrations")
    async with conn.transaction():
        # The lock comes first: even CREATE ... IF NOT EXISTS races when two run at once.
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"outbox-relay:{names.qualified}",)
        )
        asked = conn.cursor(row_factory=dict_row)
        await asked.execute(
            statement(names, "migrate_access"), {"schema": names.schema, "ledger": f"{names.table}_migrations"}
        )
        access = await asked.fetchone()
        assert access is not None  # one row whatever the schema: a LEFT JOIN of a constant
        may_create = access["may_create_in_schema"]
        # CREATE ... IF NOT EXISTS checks the privilege before it looks whether the object
        # exists, so only what is missing is created: a role without CREATE can still run
        # `relay migrate` on an outbox that is up to date (every deploy may run it).
        if not access["schema_exists"]:
            if not access["may_create_schema"]:
                raise _lacks(names, access, "CREATE", f"database {access['database']}", "create the schema first")
            await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.identifier("schema")))
            may_create = True  # its owner now
        elif not access["may_use_schema"]:
            raise _lacks(names, access, "USAGE", f"schema {names.schema}", "run `relay migrate` as the schema's owner")
        if not access["ledger_exists"]:
            if not may_create:
                owner_runs = "run `relay migrate` as the schema's owner"
                raise _lacks(names, access, "CREATE", f"schema {names.schema}", owner_runs)
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} ("
                    " version integer PRIMARY KEY,"
                    " name text NOT NULL,"
                    " applied_at timestamptz NOT NULL DEFAULT now())"
                ).format(ledger)
            )
        cur = await conn.execute(sql.SQL("SELECT version FROM {}").format(ledger))
        done = {row[0] for row in await cur.fetchall()}
        pending = [(v, n, t) for v, n, t in migrations() if v not in done]
        if pending and not may_create:
            first = f"{pending[0][0]:04d}_{pending[0][1]}"
            owner_runs = f"run `relay migrate` as the schema's owner (to apply {first})"
            raise _lacks(names, access, "CREATE", f"schema {names.schema}", owner_runs)
        already = [f"{v:04d}_{n}" for v, n, _ in migrations() if v in done]
        applied = []
        for version, name, text in pending:
            label = f"{version:04d}_{name}"
            await conn.execute(names.render(text))
            await conn.execute(
                sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(ledger), (version, name)
            )
            applied.append(label)
        # Under the same lock and in the same transaction: a conversion refused rolls back
        # the migrations with it, and two `relay migrate` never convert at once.
        partitioned = await partition_outbox(conn, names, partitioning) if partitioning is not None else None
        ahead = partitioned.partitions if partitioned is not None else await keep_ahead(conn, names)
    # Only now: a refusal part-way rolls back every one of them. Debug: the caller reports
    # the result (`relay migrate` prints one line per migration; at info each was said twice).
    for label in applied:
        log.debug("applied migration %s to %s", label, names.qualified)
    return MigrationResult(
        applied=applied, already=already, partitioned=partitioned, ahead=ahead if ahead.partitioned else None
    )


def _lacks(names: OutboxNames, access: dict[str, Any], privilege: str, on: str, otherwise: str) -> MigrationRefused:
    role = _sql_name(access["role"])
    kind, _, target = on.partition(" ")
    return MigrationRefused(
        f"cannot migrate outbox {names.qualified}: role {role} lacks the {privilege} privilege on {on}"
        f" (GRANT {privilege} ON {kind.upper()} {_sql_name(target)} TO {role}), or {otherwise}"
    )


async def _refusal(conn: psycopg.AsyncConnection[Any], names: OutboxNames, exc: psycopg.Error) -> MigrationRefused:
    """One line for an error the migration's statements ran into (the transaction is rolled
    back by now, so ``conn`` can still ask what the schema holds)."""
    primary = pg_message(exc)
    where = f"cannot migrate outbox {names.qualified}"
    if isinstance(exc, pg_errors.ReadOnlySqlTransaction):
        return MigrationRefused(f"{where}: the database is read-only ({primary}); run it against the primary")
    if isinstance(exc, pg_errors.InsufficientPrivilege):
        return MigrationRefused(
            f"{where}: {primary}; run `relay migrate` as the role that owns the outbox's tables"
            f" and has the CREATE privilege on schema {names.schema}"
        )
    taken = _QUOTED.search(primary)
    owner = await _owner(conn, names, taken.group(1)) if taken else None
    whose = f", and it belongs to outbox {names.schema}.{owner}" if owner else ""
    return MigrationRefused(
        f"{where}: {primary} in schema {names.schema}{whose}; the relay creates {names.table} and objects named"
        f" {names.table}_<suffix> beside it ({', '.join(f'{names.table}_{s}' for s in _EXAMPLES)}, ...):"
        " choose another --table or --schema"
    )


# The companions people meet first; the message lists these, not all of them.
_EXAMPLES = ("migrations", "settings", "heads")


async def _owner(conn: psycopg.AsyncConnection[Any], names: OutboxNames, taken: str) -> str | None:
    """The outbox in ``names.schema`` that the object named ``taken`` is part of, if any."""
    try:
        cur = await conn.execute(statement(names, "migrate_outboxes"), {"schema": names.schema})
        outboxes = [row[0] for row in await cur.fetchall()]
    except psycopg.Error:  # only to enrich the message; the refusal stands without it
        return None
    for outbox in outboxes:
        if taken == outbox or (taken.startswith(f"{outbox}_") and taken[len(outbox) + 1 :] in companion_suffixes()):
            return str(outbox)
    return None


@cache
def companion_suffixes() -> frozenset[str]:
    """Every ``X`` of an object ``<table>_X`` that the migrations create (tables, indexes,
    functions, sequences, constraints, triggers), and the ledger's."""
    found = {"migrations"}
    for _, _, text in migrations():
        for _, key, _, _ in string.Formatter().parse(text):
            prefix, _, suffix = (key or "").partition("_")
            if prefix in ("q", "n") and suffix:
                found.add(suffix)
    return frozenset(found)


def _sql_name(name: str) -> str:
    """``name`` as it would be written in SQL: plain when it can be, else double-quoted."""
    return name if _SIMPLE_NAME.match(name) else '"' + name.replace('"', '""') + '"'


def pg_message(exc: psycopg.Error) -> str:
    """PostgreSQL's own one-line message (it names objects, never the connection string)."""
    text = exc.diag.message_primary or str(exc).strip()
    lines = text.splitlines()
    return lines[0] if lines else type(exc).__name__
