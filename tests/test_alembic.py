"""Alembic's autogenerate beside the relay's tables: with the `include_name` of
examples/alembic_env.py it proposes nothing for them (an app's own model compared against a
database that also holds a migrated outbox and inbox); without it, it would drop them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import Inbox
from relay.db.migrate import migrate
from tests.helpers import sqlalchemy_url

pytest.importorskip("alembic")


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    # The function of examples/alembic_env.py, word for word (that file imports the reader's
    # own models, so it cannot be imported here).
    if type_ == "table" and name is not None:
        return not any(name == t or name.startswith(t + "_") for t in ("outbox", "inbox"))
    return True


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"a_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


async def test_autogenerate_leaves_the_relays_tables_alone(pg_dsn: str, schema: str) -> None:
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from relay.db.names import OutboxNames

    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, OutboxNames(schema=schema, table="outbox"))
    with psycopg.connect(pg_dsn) as conn:
        Inbox("inbox", schema).migrate(conn)
        conn.execute(
            sql.SQL("CREATE TABLE {}.orders (id bigint PRIMARY KEY, amount numeric NOT NULL)").format(
                sql.Identifier(schema)
            )
        )
    metadata = sa.MetaData(schema=schema)
    sa.Table("orders", metadata, sa.Column("id", sa.BigInteger, primary_key=True),
             sa.Column("amount", sa.Numeric, nullable=False))  # fmt: skip
    engine = sa.create_engine(sqlalchemy_url(pg_dsn))
    try:
        with engine.connect() as conn:
            options: dict[str, Any] = {"include_schemas": True, "include_name": _in(schema)}
            without = compare_metadata(MigrationContext.configure(conn, opts=options), metadata)
            options["include_name"] = _in(schema, include_name)
            filtered = compare_metadata(MigrationContext.configure(conn, opts=options), metadata)
    finally:
        engine.dispose()
    dropped = {d[1].name for d in without if d[0] == "remove_table"}
    assert {"outbox", "outbox_heads", "outbox_migrations", "inbox", "inbox_aggregates"} <= dropped
    assert filtered == []


def _in(schema: str, inner: Any = None) -> Any:
    """Only ``schema`` (the test database holds every other test's), then ``inner``."""

    def include(name: str | None, type_: str, parent_names: Any) -> bool:
        if type_ == "schema":
            return name == schema
        return inner is None or bool(inner(name, type_, parent_names))

    return include
