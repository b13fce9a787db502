"""Fixtures: a real PostgreSQL, one fresh schema per test, and helpers to fill the outbox.

The broker fixtures (``amqp``, ``rabbit``, ``ctl``, ``proxy``; ``moto_endpoint``,
``sqs_client``, ``make_queue``; ``sns_client``, ``make_topic``; ``aws_kind`` and ``aws``,
SQS and SNS side by side; ``pg_pair``, a primary and its synchronous standby;
``console_factory``, the web console on a loopback port) live beside the services they
stand for and are registered here as plugins, so a test module names them as parameters
and never imports them. tests/service_split.py marks each test that needs one of them
(or PostgreSQL) ``integration``; the others are unit tests.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

# The suite tests the built-in destinations: the installed ones (tests/plugins/, installed
# by make venv) stay out of --broker's choices, --help and the config file's tables in this
# process and every relay it starts, except where a test turns them back on to test one.
# Set before anything of relay is imported: the registry reads it when it lists names.
os.environ["OUTBOX_RELAY_DISABLE_PLUGIN_AUTOLOAD"] = "1"

from relay.db.dispatch import OutboxStore
from relay.db.grants import GRANTS_LOCK, Grantee, grant
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.db.statements import schema_sql
from relay.ordering import OrderingMap
from tests.helpers import create_outbox_at
from tests.relay_process import RelayProcess
from tests.services import SKIP_PG, postgres_dsn, require_services

pytest_plugins = (
    "tests.rabbitmq_broker",
    "tests.sqs_server",
    "tests.sns_server",
    "tests.aws_destinations",
    "tests.pg_clusters",
    "tests.kafka_broker",
    "tests.nats_server",
    "tests.console_seed",
    "tests.http_receiver",
    "tests.service_split",
)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with postgres_dsn() as dsn:
        if dsn is None:
            if require_services():
                pytest.fail(SKIP_PG)
            pytest.skip(SKIP_PG)
        vacuum_catalogs(dsn)
        yield dsn
        vacuum_catalogs(dsn)


@pytest.fixture
def scratch_dsn(pg_dsn: str) -> Iterator[str]:
    """A database of its own on the test server, empty (the public schema only), dropped
    afterwards with whatever the test made in it: for what a schema drop cannot clean up,
    or a reader's fresh database."""
    name = f"relay_scratch_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(pg_dsn, dbname=name)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def vacuum_catalogs(dsn: str) -> None:
    """VACUUM the system catalogs of the test database, before and after a session.

    Every test creates and drops a schema (an outbox, its indexes, triggers, functions
    and grants), and this machine's PostgreSQL runs without autovacuum, so the dead
    catalog rows were never reclaimed: after a few runs pg_attribute held 314,642 dead
    rows and pg_depend 223,845, and the test database had grown to 143 MB (51 MB once
    vacuumed; a run was not measurably faster for it, but nothing now grows run after
    run). Catalogs only: a RELAY_TEST_DSN
    may name a database with data of its own. Without the rights, PostgreSQL skips a table
    with a warning, and so does this.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        catalogs = conn.execute(
            "SELECT relname FROM pg_class WHERE relnamespace = 'pg_catalog'::regnamespace AND relkind = 'r'"
        ).fetchall()
        tables = sql.SQL(", ").join(sql.Identifier("pg_catalog", name) for (name,) in catalogs)
        conn.execute(sql.SQL("VACUUM {}").format(tables))


@dataclass(frozen=True)
class Roles:
    """The two non-superuser login roles the suite's producers and relays run as: granted
    on each test's outbox by `names`, exactly what `relay migrate --grant-producer
    --grant-relay` grants (relay.db.grants). ``pg_dsn`` (a superuser) only migrates, and
    arranges or inspects what a test needs."""

    producer: str
    relay: str
    producer_dsn: str
    relay_dsn: str


def dsn_as(dsn: str, role: str) -> str:
    """``dsn`` logging in as ``role`` (trust authentication on the test server)."""
    return make_conninfo(**{**conninfo_to_dict(dsn), "user": role})


@pytest.fixture(scope="session")
def roles(pg_dsn: str) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:10]
    producer, relay = f"test_producer_{suffix}", f"test_relay_{suffix}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for role in (producer, relay):
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE").format(sql.Identifier(role))
            )
    yield Roles(producer, relay, dsn_as(pg_dsn, producer), dsn_as(pg_dsn, relay))
    drop_roles(pg_dsn, producer, relay)


def drop_roles(pg_dsn: str, *roles: str) -> None:
    """Drop ``roles`` and whatever they still own or were granted.

    Revoking a database privilege (TEMPORARY) rewrites the database's catalog row, as
    another xdist worker's grant() may at the same moment, and PostgreSQL fails one of
    the two with "tuple concurrently updated": this takes grant()'s lock first."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (GRANTS_LOCK,))
        for role in roles:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture
async def names(pg_dsn: str, roles: Roles) -> AsyncIterator[OutboxNames]:
    """A migrated outbox in a schema of its own, its producer and relay roles granted,
    dropped after the test."""
    names = OutboxNames(schema=f"t_{uuid.uuid4().hex[:12]}", table="outbox")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        # Loaded from sql/schema.sql, which tests/test_schema_file.py holds identical to
        # every migration applied (ledger included): 40 ms instead of migrate()'s 113 ms,
        # some 45 s of a suite that makes ~600 outboxes. migrate() has tests of its own.
        async with conn.transaction():
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
            await conn.execute(names.render(schema_sql()))
        await grant(conn, names, [Grantee("producer", roles.producer), Grantee("relay", roles.relay)])
    yield names
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(names.schema)))


@pytest.fixture
def outbox_at(pg_dsn: str) -> Iterator[Callable[[int], OutboxNames]]:
    """``outbox_at(version)``: an outbox in a schema of its own with the shipped migrations
    applied up to ``version`` only, as an earlier release left it (for upgrade tests);
    every one made is dropped after the test."""
    made: list[OutboxNames] = []

    def make(version: int) -> OutboxNames:
        names = OutboxNames(schema=f"t_{uuid.uuid4().hex[:12]}", table="outbox")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            create_outbox_at(conn, names, version)
        made.append(names)
        return names

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for names in made:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(names.schema)))


@pytest.fixture
def producer_dsn(roles: Roles, names: OutboxNames) -> str:
    """The producers' role on this test's outbox (INSERT of the producer columns, SELECT of id)."""
    return roles.producer_dsn


@pytest.fixture
def relay_dsn(roles: Roles, names: OutboxNames) -> str:
    """The relays' role on this test's outbox (DML on its tables, no DDL): for `pool`,
    `store` and every relay process a test starts."""
    return roles.relay_dsn


@pytest.fixture
async def pool(relay_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """The relay's in-process pool, as the relay role."""
    p: AsyncConnectionPool[Any] = AsyncConnectionPool(
        relay_dsn, min_size=1, max_size=10, open=False, kwargs={"autocommit": True}
    )
    await p.open(wait=True)
    yield p
    await p.close()


@pytest.fixture
async def owner_pool(pg_dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A pool as the owner, for outboxes `names` did not make (outbox_at: an earlier
    release's schema, which the grants of this release do not fit)."""
    p: AsyncConnectionPool[Any] = AsyncConnectionPool(
        pg_dsn, min_size=1, max_size=10, open=False, kwargs={"autocommit": True}
    )
    await p.open(wait=True)
    yield p
    await p.close()


@pytest.fixture
def make_store(pool: AsyncConnectionPool[Any], names: OutboxNames) -> Callable[..., Awaitable[OutboxStore]]:
    """A store, with ``ordering`` stored first as the outbox's shared map (what `relay
    migrate --ordered ...` and `relay settings set` do), so rows inserted afterwards are
    routed by it."""

    async def make(ordering: OrderingMap | None = None) -> OutboxStore:
        async with pool.connection() as conn:
            await store_ordering(conn, names, ordering or OrderingMap())
        return OutboxStore(pool, names)

    return make


@pytest.fixture
async def store(make_store: Callable[..., Awaitable[OutboxStore]]) -> OutboxStore:
    return await make_store()


@pytest.fixture
def relays() -> Iterator[list[RelayProcess]]:
    """Relay processes a test starts (``relays.append(RelayProcess(...))``); any still
    running at teardown are killed and their output files removed."""
    started: list[RelayProcess] = []
    yield started
    for process in started:
        process.close()


@pytest.fixture
def db(pg_dsn: str, producer_dsn: str, names: OutboxNames) -> Iterator[Db]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn, psycopg.connect(producer_dsn, autocommit=True) as producer:
        yield Db(conn, names, producer)


class Db:
    """Synchronous helpers for arranging and inspecting the outbox in tests: ``conn`` is
    the owner's, ``producer`` (for :meth:`insert`) the producer role's."""

    def __init__(
        self, conn: psycopg.Connection[Any], names: OutboxNames, producer: psycopg.Connection[Any] | None = None
    ) -> None:
        self.conn = conn
        self.producer = producer or conn
        self.names = names
        self.table = sql.Identifier(names.schema, names.table)

    def insert(self, rows: Iterable[tuple[str, str, Any]], aggregate_type: str = "order") -> list[int]:
        """Insert (aggregate_id, event_type, payload) rows the way a producer would, as the producer role."""
        ids = []
        with self.producer.transaction():
            for aggregate_id, event_type, payload in rows:
                cur = self.producer.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                        " VALUES (%s, %s, %s, %s) RETURNING id"
                    ).format(self.table),
                    (aggregate_type, aggregate_id, event_type, json.dumps(payload)),
                )
                row = cur.fetchone()
                assert row is not None
                ids.append(row[0])
        return ids

    def rows(self, where: str = "true") -> list[dict[str, Any]]:
        cur = self.conn.cursor(row_factory=psycopg.rows.dict_row)
        cur.execute(sql.SQL("SELECT * FROM {} WHERE " + where + " ORDER BY id").format(self.table))
        return cur.fetchall()

    def row(self, outbox_id: int) -> dict[str, Any]:
        [found] = self.rows(f"id = {int(outbox_id)}")
        return found

    def statuses(self) -> dict[str, int]:
        cur = self.conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(self.table))
        return dict(cur.fetchall())

    def at_rest(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every row, read at a moment when none is under a lease (or the last read after
        ``timeout`` seconds). A held message is claimed now and then to probe its destination,
        its attempt refunded when the probe fails, so attempts are judged between probes."""
        deadline = time.monotonic() + timeout
        rows = self.rows()
        while any(r["status"] == "processing" for r in rows) and time.monotonic() < deadline:
            time.sleep(0.02)
            rows = self.rows()
        return rows

    def settled(self, count: int) -> bool:
        """Whether ``count`` rows have finished, delivered or dead."""
        statuses = self.statuses()
        return statuses.get("done", 0) + statuses.get("dead", 0) == count

    def expire_leases(self) -> None:
        """Move every lease into the past: what waiting out the lease would do, without the wait."""
        self.conn.execute(
            sql.SQL("UPDATE {} SET lease_until = now() - interval '1 second' WHERE status = 'processing'").format(
                self.table
            )
        )

    def make_available(self) -> None:
        """Pull every backoff forward so rescheduled rows are ready now."""
        self.conn.execute(sql.SQL("UPDATE {} SET available_at = now() WHERE status = 'pending'").format(self.table))
