"""`sql/schema.sql` is the schema an empty database reaches after every migration: every
migration applied to one fresh schema, the file loaded into another, and their catalogs
compared with the schema name taken out.

What is compared is what the relay and its producers see: relations, columns (in order,
with type, nullability, default, identity), constraints, indexes, triggers, functions,
sequences, types, comments, and the rows the schema ships with. Not compared: privileges
and owners, OIDs, and storage details (a column added with ALTER TABLE keeps its default
for rows that already existed in attmissingval; a created one does not).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.statements import migrations, schema_sql

# One catalog query per aspect, each taking the schema's name as %(schema)s and sorted, so
# that two schemas built alike give equal lists. Test-only: the relay never runs these.
_CATALOG: dict[str, str] = {
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, c.relreplident, c.relrowsecurity,
               array_to_string(c.reloptions, ',') AS reloptions
          FROM pg_class AS c
         WHERE c.relnamespace = %(schema)s::regnamespace
         ORDER BY c.relname""",
    # Ordered by position: a table whose columns come in another order reads differently
    # to SELECT * and to an INSERT without a column list.
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid) AS default, a.attidentity, a.attgenerated
          FROM pg_attribute AS a
          JOIN pg_class AS c ON c.oid = a.attrelid
          LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE c.relnamespace = %(schema)s::regnamespace
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
           AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY c.relname, a.attnum""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid) AS definition,
               k.condeferrable, k.condeferred, k.convalidated
          FROM pg_constraint AS k
          LEFT JOIN pg_class AS c ON c.oid = k.conrelid
         WHERE k.connamespace = %(schema)s::regnamespace
         ORDER BY c.relname, k.conname""",
    "indexes": """
        SELECT i.relname, pg_get_indexdef(i.oid) AS definition, x.indisvalid
          FROM pg_index AS x
          JOIN pg_class AS i ON i.oid = x.indexrelid
         WHERE i.relnamespace = %(schema)s::regnamespace
         ORDER BY i.relname""",
    # Internal triggers (those of foreign keys) follow from the constraints compared above.
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid) AS definition, t.tgenabled
          FROM pg_trigger AS t
          JOIN pg_class AS c ON c.oid = t.tgrelid
         WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal
         ORDER BY c.relname, t.tgname""",
    # pg_get_functiondef is the whole CREATE statement: language, volatility, body.
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) AS arguments,
               pg_get_function_result(p.oid) AS result, pg_get_functiondef(p.oid) AS definition
          FROM pg_proc AS p
         WHERE p.pronamespace = %(schema)s::regnamespace
         ORDER BY p.proname, arguments""",
    "sequences": """
        SELECT s.sequencename, s.data_type::text, s.start_value, s.min_value, s.max_value,
               s.increment_by, s.cycle, s.cache_size, s.last_value
          FROM pg_sequences AS s
         WHERE s.schemaname = %(schema)s
         ORDER BY s.sequencename""",
    "types": """
        SELECT t.typname, t.typtype
          FROM pg_type AS t
         WHERE t.typnamespace = %(schema)s::regnamespace
         ORDER BY t.typname""",
    # Comments on anything in the schema: tables, columns, constraints, functions, ...;
    # triggers have no schema of their own, so they are found through their table.
    "comments": """
        SELECT o.type, o.identity, d.description
          FROM pg_description AS d
         CROSS JOIN LATERAL pg_identify_object(d.classoid, d.objoid, d.objsubid) AS o
         WHERE o.schema = %(schema)s
            OR (d.classoid = 'pg_trigger'::regclass
                AND d.objoid IN (SELECT t.oid
                                   FROM pg_trigger AS t
                                   JOIN pg_class AS c ON c.oid = t.tgrelid
                                  WHERE c.relnamespace = %(schema)s::regnamespace))
         ORDER BY o.type, o.identity""",
}


async def _describe(conn: psycopg.AsyncConnection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every aspect of ``schema``'s catalog, with its name replaced by ``<schema>``."""

    def normalized(row: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(value.replace(schema, "<schema>") if isinstance(value, str) else value for value in row)

    described: dict[str, list[tuple[Any, ...]]] = {}
    for aspect, query in _CATALOG.items():
        cur = await conn.execute(query, {"schema": schema})
        described[aspect] = [normalized(row) for row in await cur.fetchall()]
    described["rows"] = await _rows(conn, schema, described["columns"])
    return described


async def _rows(
    conn: psycopg.AsyncConnection[Any], schema: str, columns: list[tuple[Any, ...]]
) -> list[tuple[Any, ...]]:
    """The rows of every table (the settings and other singletons, the ledger), without the
    columns that default to now(): those say when the schema was built, not what it holds."""
    stamped = {(table, column) for table, column, _, _, default, _, _ in columns if default == "now()"}
    tables = sorted({table for table, *_ in columns})
    found = []
    for table in tables:
        cur = await conn.execute(sql.SQL("SELECT to_jsonb(t) FROM {} AS t").format(sql.Identifier(schema, table)))
        for (row,) in await cur.fetchall():
            kept = {key: value for key, value in row.items() if (table, key) not in stamped}
            found.append((table, sorted(kept.items())))
    return sorted(found, key=repr)


@pytest.fixture
async def schemas(pg_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """Two fresh, empty schemas: one to migrate, one to load sql/schema.sql into."""
    token = uuid.uuid4().hex[:12]
    pair = (f"t_{token}_migrated", f"t_{token}_loaded")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for schema in pair:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    yield pair
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for schema in pair:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def _build(pg_dsn: str, schemas: tuple[str, str], table: str) -> tuple[OutboxNames, OutboxNames]:
    migrated, loaded = (OutboxNames(schema=schema, table=table) for schema in schemas)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, migrated)
        await conn.execute(loaded.render(schema_sql()))
    return migrated, loaded


# A table name other than the default proves that the file names every object through
# its placeholders.
@pytest.mark.parametrize("table", ["outbox", "events"])
async def test_the_schema_file_is_what_every_migration_builds(
    pg_dsn: str, schemas: tuple[str, str], table: str
) -> None:
    migrated, loaded = await _build(pg_dsn, schemas, table)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        want = await _describe(conn, migrated.schema)
        got = await _describe(conn, loaded.schema)
    # Not two empty descriptions compared: the migrated schema holds the outbox, its
    # companions and the ledger, and something of every aspect.
    assert {(table, "r"), (f"{table}_heads", "r"), (f"{table}_migrations", "r")} <= {
        (name, kind) for name, kind, *_ in want["relations"]
    }
    assert all(want.values()), [aspect for aspect, found in want.items() if not found]
    for aspect in want:
        assert got[aspect] == want[aspect], f"sql/schema.sql and the migrations differ in {aspect}"


async def test_relay_migrate_finds_a_loaded_schema_up_to_date(pg_dsn: str, schemas: tuple[str, str]) -> None:
    """The file carries the ledger's rows: `relay migrate` applies nothing to a schema
    loaded from it, and names every migration as applied."""
    _, loaded = await _build(pg_dsn, schemas, "outbox")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await migrate(conn, loaded)
    assert result.applied == []
    assert result.already == [f"{version:04d}_{name}" for version, name, _ in migrations()]
