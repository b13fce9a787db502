"""`relay migrate` against what the database refuses: a system schema, a name another object
already holds, a privilege the role lacks, a read-only or missing database. Each is one line
on stderr with exit code 2, never a traceback, and leaves the database as it was."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import conninfo, sql

from relay.db.names import OutboxNames
from tests.conftest import drop_roles
from tests.helpers import create_outbox_at
from tests.relay_process import assert_one_line_error, run_relay


def exists(pg_dsn: str, qualified: str) -> bool:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [(found,)] = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (qualified,)).fetchall()
    return bool(found)


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"mig_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def role(pg_dsn: str) -> Iterator[str]:
    """A login role of its own (trust authentication lets a DSN name it), with no privileges."""
    name = f"relay_enc_r_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield name
    drop_roles(pg_dsn, name)


def as_role(pg_dsn: str, role: str) -> str:
    return conninfo.make_conninfo(pg_dsn, user=role)


@pytest.mark.parametrize("system", ["pg_catalog", "information_schema", "pg_toast", "pg_temp", "pg_temp_3"])
def test_a_system_schema_is_refused_before_anything_is_created(scratch_dsn: str, system: str) -> None:
    proc = run_relay("migrate", "--dsn", scratch_dsn, "--schema", system)
    assert_one_line_error(proc, f"cannot migrate outbox {system}.outbox", "is a system schema of PostgreSQL")
    # The superuser could have created tables in information_schema (in a database of its
    # own: no schema drop would clean that up): nothing was.
    assert not exists(scratch_dsn, f"{system}.outbox_migrations")
    assert not exists(scratch_dsn, f"{system}.outbox")


def test_a_table_named_like_another_outboxs_companion_is_refused(pg_dsn: str, schema: str) -> None:
    assert run_relay("migrate", "--dsn", pg_dsn, "--schema", schema).returncode == 0
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", schema, "--table", "outbox_heads")
    assert_one_line_error(
        proc,
        f"cannot migrate outbox {schema}.outbox_heads",
        '"outbox_heads" already exists',
        f"it belongs to outbox {schema}.outbox",
        "choose another --table",
    )
    assert pg_dsn not in proc.stderr
    # One transaction: not even the ledger of the refused outbox was left behind.
    assert not exists(pg_dsn, f"{schema}.outbox_heads_migrations")


def test_an_outbox_whose_companion_is_taken_by_an_earlier_outbox_is_refused(pg_dsn: str, schema: str) -> None:
    """The other way round: `outbox_heads` came first, so `outbox` cannot have its heads table."""
    assert run_relay("migrate", "--dsn", pg_dsn, "--schema", schema, "--table", "outbox_heads").returncode == 0
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", schema)
    assert_one_line_error(
        proc, f"cannot migrate outbox {schema}.outbox", '"outbox_heads" already exists', f"outbox {schema}.outbox_heads"
    )
    assert not exists(pg_dsn, f"{schema}.outbox")
    assert not exists(pg_dsn, f"{schema}.outbox_migrations")


def test_a_table_of_the_application_with_the_outboxs_name_is_refused(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("CREATE TABLE {} (id int)").format(sql.Identifier(schema, "orders")))
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", schema, "--table", "orders")
    err = assert_one_line_error(proc, '"orders" already exists', f"in schema {schema}", "choose another --table")
    assert "belongs to" not in err
    assert not exists(pg_dsn, f"{schema}.orders_migrations")


def test_a_role_without_create_on_the_schema_is_told_which_privilege(pg_dsn: str, schema: str, role: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), sql.Identifier(role)))
    proc = run_relay("migrate", "--dsn", as_role(pg_dsn, role), "--schema", schema)
    assert_one_line_error(
        proc,
        f"cannot migrate outbox {schema}.outbox",
        f"role {role} lacks the CREATE privilege on schema {schema}",
        f"GRANT CREATE ON SCHEMA {schema} TO {role}",
    )
    assert not exists(pg_dsn, f"{schema}.outbox_migrations")


def test_a_role_that_may_not_create_the_schema_is_told_which_privilege(pg_dsn: str, schema: str, role: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [(database, may)] = conn.execute(
            "SELECT current_database()::text, has_database_privilege(%s, current_database(), 'CREATE')", (role,)
        ).fetchall()
    if may:
        pytest.skip(f"every role may create schemas in database {database} here")
    proc = run_relay("migrate", "--dsn", as_role(pg_dsn, role), "--schema", schema)
    assert_one_line_error(
        proc, f"role {role} lacks the CREATE privilege on database {database}", "or create the schema first"
    )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace(%s)", (schema,)).fetchone() == (None,)


def test_an_up_to_date_outbox_needs_no_create_privilege(pg_dsn: str, schema: str, role: str) -> None:
    """Deploys that run `relay migrate` every time as the application's role keep working."""
    assert run_relay("migrate", "--dsn", pg_dsn, "--schema", schema).returncode == 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(schema), sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT SELECT ON {} TO {}").format(
                sql.Identifier(schema, "outbox_migrations"), sql.Identifier(role)
            )
        )
    proc = run_relay("migrate", "--dsn", as_role(pg_dsn, role), "--schema", schema)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout


def test_an_upgrade_by_a_role_that_does_not_own_the_outbox_is_refused_in_one_line(
    pg_dsn: str, schema: str, role: str
) -> None:
    names = OutboxNames(schema=schema, table="outbox")
    ledger = sql.Identifier(schema, "outbox_migrations")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        create_outbox_at(conn, names, 3)  # the outbox as the release before 0004 left it
        conn.execute(
            sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(sql.Identifier(schema), sql.Identifier(role))
        )
        conn.execute(sql.SQL("GRANT SELECT, INSERT ON {} TO {}").format(ledger, sql.Identifier(role)))
    proc = run_relay("migrate", "--dsn", as_role(pg_dsn, role), "--schema", schema)
    assert_one_line_error(
        proc, f"cannot migrate outbox {schema}.outbox", "must be owner", "run `relay migrate` as the role that owns"
    )
    assert not exists(pg_dsn, f"{schema}.outbox_ingest")  # 0004 rolled back whole


def test_a_read_only_session_is_refused_in_one_line(pg_dsn: str, schema: str) -> None:
    read_only = conninfo.make_conninfo(pg_dsn, options="-c default_transaction_read_only=on")
    proc = run_relay("migrate", "--dsn", read_only, "--schema", schema)
    assert_one_line_error(proc, f"cannot migrate outbox {schema}.outbox", "the database is read-only")


def test_a_missing_database_is_one_line(pg_dsn: str) -> None:
    missing = f"relay_enc_missing_{uuid.uuid4().hex[:8]}"
    proc = run_relay("migrate", "--dsn", conninfo.make_conninfo(pg_dsn, dbname=missing))
    assert_one_line_error(proc, "cannot connect to PostgreSQL", f"database '{missing}'", "does not exist")
