"""`make demo` (scripts/demo.py) works in a database of its own: it once dropped and
recreated its schema in the database of its --dsn, by default the shared `test` database
(issue 25, finding 10)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from scripts.demo import DATABASE, SCHEMA, migrate, own_database, parse_args

ROOT = Path(__file__).resolve().parent.parent


def schema_oid(dsn: str) -> int | None:
    """The demo schema's oid in ``dsn``'s database: None when absent, another number once
    something dropped and recreated it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT oid::bigint FROM pg_namespace WHERE nspname = %s", (SCHEMA,)).fetchone()
    return None if row is None else int(row[0])


@pytest.fixture
def demo_database(pg_dsn: str) -> Iterator[str]:
    """A database name no one uses, dropped after the test (with whatever made it)."""
    name = f"relay_demo_test_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_the_demo_creates_its_own_database_and_leaves_the_dsns_alone(pg_dsn: str, demo_database: str) -> None:
    assert parse_args([]).database == DATABASE == "outbox_relay_demo"
    before = schema_oid(pg_dsn)
    demo_dsn = own_database(pg_dsn, demo_database)
    assert conninfo_to_dict(demo_dsn)["dbname"] == demo_database
    assert own_database(pg_dsn, demo_database) == demo_dsn  # there now: used as it is
    migrate(demo_dsn)
    assert schema_oid(demo_dsn) is not None
    assert schema_oid(pg_dsn) == before  # the test database: not dropped, not created


@pytest.mark.extended
def test_a_small_demo_passes_in_its_own_database(pg_dsn: str, demo_database: str) -> None:
    before = schema_oid(pg_dsn)
    args = ["--dsn", pg_dsn, "--database", demo_database, "--orders", "6", "--producers", "2", "--workers", "2"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "PASS: every event arrived exactly once" in proc.stdout
    assert f"created database {demo_database!r}" in proc.stdout
    with psycopg.connect(pg_dsn, dbname=demo_database, autocommit=True) as conn:
        statuses = conn.execute(
            sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(sql.Identifier(SCHEMA, "outbox"))
        ).fetchall()
    assert dict(statuses).keys() == {"done"} and dict(statuses)["done"] > 0
    assert schema_oid(pg_dsn) == before
