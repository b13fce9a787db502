"""The producer and relay roles (sql/grants.sql, relay.db.grants): what each may do, what each
may not, `relay grants` applied by a DBA, and bad input. The suite's fixtures (`names`,
`producer_dsn`, `relay_dsn`) grant the session's two roles on every test's outbox."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.db.grants import Grantee, grant
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.ordering import OrderingMap
from tests.conftest import Db, drop_roles, dsn_as
from tests.helpers import record_listeners
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until

INSERT = "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload{}) VALUES (%s, %s, %s, %s{}) RETURNING id"


def _insert(conn: psycopg.Connection[Any], names: OutboxNames, aggregate: str, event_type: str, **extra: Any) -> int:
    columns = "".join(f", {c}" for c in extra)
    values = ", %s" * len(extra)
    text = INSERT.format("{}", columns, values)
    params = ("order", aggregate, event_type, "{}", *(json.dumps(v) for v in extra.values()))
    [(oid,)] = conn.execute(sql.SQL(text).format(sql.Identifier(names.schema, names.table)), params).fetchall()
    return int(oid)


@pytest.fixture
def other_roles(pg_dsn: str) -> Iterator[tuple[str, str]]:
    """Two roles of this test alone, granted nothing yet (a DBA grants them)."""
    suffix = uuid.uuid4().hex[:8]
    made = (f"dba producer {suffix}", f"dba-relay-{suffix}")  # identifiers that need quoting
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for role in made:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield made
    drop_roles(pg_dsn, *made)


# ---- producers


@pytest.mark.parametrize("relay_idle", [True, False])
async def test_a_producer_writes_ordered_and_unordered_events_with_and_without_headers(
    pg_dsn: str, names: OutboxNames, producer_dsn: str, relay_idle: bool
) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await store_ordering(conn, names, OrderingMap(unordered=("Audit",)))
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(names.qualified)))
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            record_listeners(admin, names, [("r:1", relay_idle, "1 hour")])
        with psycopg.connect(producer_dsn) as producer:
            ids = [
                _insert(producer, names, "o-1", "OrderPlaced"),
                _insert(producer, names, "o-1", "OrderPaid", headers={"tenant": "t-1"}),
                _insert(producer, names, "o-1", "Audit", headers={"k": "v"}),
                _insert(producer, names, "o-2", "Audit"),
            ]
            producer.commit()
        heard = [n async for n in conn.notifies(timeout=1, stop_after=1)]
        assert len(heard) == (1 if relay_idle else 0)  # the NOTIFY path, as the producer
        cur = await conn.execute(
            sql.SQL("SELECT id, event_type, ordered, headers, payload_bytes > 0 FROM {} ORDER BY id").format(
                sql.Identifier(names.schema, names.table)
            )
        )
        assert await cur.fetchall() == [
            (ids[0], "OrderPlaced", True, None, True),
            (ids[1], "OrderPaid", True, {"tenant": "t-1"}, True),
            (ids[2], "Audit", False, {"k": "v"}, True),
            (ids[3], "Audit", False, None, True),
        ]
        cur = await conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(names.schema, f"{names.table}_commits"))
        )
        assert await cur.fetchone() == (1,)  # the commit stamp, drawn as the producer


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE {t} SET status = 'done'",
        "UPDATE {t} SET lease_until = now(), lease_version = lease_version + 1",
        "UPDATE {t} SET lease_owner = 'me'",
        "UPDATE {t} SET payload = '{{}}'",
        "DELETE FROM {t}",
        "SELECT payload FROM {t}",
        "SELECT * FROM {t}",
        "SELECT aggregate_id FROM {t}",
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, status)"
        " VALUES ('o', 'a', 'E', '{{}}', 'done')",
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, ordered)"
        " VALUES ('o', 'a', 'E', '{{}}', false)",
        "UPDATE {s} SET notify = false",
        "DELETE FROM {c}",
        # The commit stamp is drawn as the owner (0011): a producer cannot forge one.
        "INSERT INTO {c} (stamp, xid) VALUES (1, '1')",
        "SELECT nextval('{q}')",
        "SELECT * FROM {h}",
        "CREATE TABLE {x} (i int)",
        "ALTER TABLE {t} DISABLE TRIGGER ALL",
    ],
)
def test_a_producer_cannot_touch_the_relays_columns_nor_read_payloads(
    db: Db, producer_dsn: str, statement: str
) -> None:
    [oid] = db.insert([("o-1", "OrderPlaced", {"secret": 1})])
    n = db.names
    text = sql.SQL(statement).format(
        t=sql.Identifier(n.schema, n.table),
        s=sql.Identifier(n.schema, f"{n.table}_settings"),
        c=sql.Identifier(n.schema, f"{n.table}_commits"),
        h=sql.Identifier(n.schema, f"{n.table}_heads"),
        x=sql.Identifier(n.schema, "producer_table"),
        q=sql.SQL(sql.Identifier(n.schema, f"{n.table}_commit_stamp").as_string(None)),
    )
    with psycopg.connect(producer_dsn, autocommit=True) as producer:
        with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedTable)) as caught:
            producer.execute(text)
        assert isinstance(caught.value, psycopg.errors.InsufficientPrivilege), caught.value
        # What it may read of its rows: the ids (INSERT ... RETURNING id), nothing else.
        assert producer.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(n.schema, n.table))).fetchall() == [
            (oid,)
        ]
    assert db.row(oid)["status"] == "pending"


# ---- relays


def test_a_relay_role_runs_the_relay_end_to_end(db: Db, relay_dsn: str, tmp_path: Path) -> None:
    """relay start, status, dead retry, prune and replay --dry-run, all as the relay role."""
    n = db.names
    ids = db.insert((f"order-{i % 5}", "OrderPlaced", {"i": i}) for i in range(20))
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_SCHEMA=n.schema)
    with RelayProcess("start", "--broker", "log", "--poll-interval", "100ms", env=env) as proc:
        try:
            assert wait_until(lambda: db.statuses() == {"done": 20}, timeout=30), proc.tail()
        finally:
            proc.stop()
        out, err = proc.stdout(), proc.stderr()
    assert proc.returncode == 0, err
    assert sorted(json.loads(line)["outbox_id"] for line in out.splitlines()) == ids

    status = run_relay("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'dead' WHERE id = %s").format(db.table), (ids[-1],))
    retried = run_relay("dead", "retry", str(ids[-1]), env=env)
    assert retried.returncode == 0, retried.stderr
    assert db.row(ids[-1])["status"] == "pending"
    replay = run_relay("replay", "--from-id", str(ids[0]), "--broker", "log", "--dry-run", env=env)
    assert replay.returncode == 0, replay.stderr
    assert "19" in replay.stdout + replay.stderr  # the done rows: the retried one is pending again
    pruned = run_relay("prune", "--older-than", "0s", env=env)
    assert pruned.returncode == 0, pruned.stderr
    assert db.statuses() == {"pending": 1}
    changed = run_relay("settings", "set", "--no-notify", env=env)
    assert changed.returncode == 0, changed.stderr


@pytest.mark.parametrize(
    "statement",
    [
        "CREATE TABLE {x} (i int)",
        "CREATE INDEX ON {t} (created_at)",
        "ALTER TABLE {t} ADD COLUMN extra int",
        "ALTER TABLE {t} DISABLE TRIGGER ALL",
        "DROP TABLE {t}",
        "DROP TRIGGER {route} ON {t}",
        "TRUNCATE {t}",
        "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
        "INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', 'a', 'E', '{{}}')",
        "INSERT INTO {m} (version, name) VALUES (99, 'forged')",
    ],
)
def test_a_relay_role_cannot_change_the_schema(db: Db, relay_dsn: str, statement: str) -> None:
    n = db.names
    text = sql.SQL(statement).format(
        t=sql.Identifier(n.schema, n.table),
        x=sql.Identifier(n.schema, "relay_table"),
        route=sql.Identifier(f"{n.table}_route"),
        f=sql.Identifier(n.schema, f"{n.table}_route"),
        m=sql.Identifier(n.schema, f"{n.table}_migrations"),
    )
    with psycopg.connect(relay_dsn, autocommit=True) as relay, pytest.raises(psycopg.errors.InsufficientPrivilege):
        relay.execute(text)
    with psycopg.connect(relay_dsn, autocommit=True) as relay:
        assert relay.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchall() == [(False,)]


def test_relay_migrate_needs_the_owner(names: OutboxNames, relay_dsn: str) -> None:
    """Up to date, a relay role may run `relay migrate` (every deploy may); it cannot create."""
    assert run_relay("migrate", "--dsn", relay_dsn, "--schema", names.schema).returncode == 0
    fresh = f"t_{uuid.uuid4().hex[:12]}"
    assert_one_line_error(run_relay("migrate", "--dsn", relay_dsn, "--schema", fresh), "CREATE")


# ---- relay grants, relay migrate --grant-*


def test_relay_grants_prints_sql_a_dba_applies(
    pg_dsn: str, names: OutboxNames, other_roles: tuple[str, str], tmp_path: Path
) -> None:
    producer, relay = other_roles
    env = relay_env(RELAY_DSN=pg_dsn, RELAY_SCHEMA=names.schema)
    printed = run_relay("grants", "--grant-producer", producer, "--grant-relay", relay, env=env)
    assert printed.returncode == 0, printed.stderr
    assert f'TO "{producer}";' in printed.stdout  # quoted as an identifier
    with psycopg.connect(pg_dsn, autocommit=True) as dba:
        dba.execute(printed.stdout.encode())  # as `psql -f` would run it
    with psycopg.connect(dsn_as(pg_dsn, producer)) as conn:
        oid = _insert(conn, names, "o-1", "OrderPlaced", headers={"h": "1"})
        conn.commit()
    renv = relay_env(RELAY_DSN=dsn_as(pg_dsn, relay), RELAY_SCHEMA=names.schema)
    with RelayProcess("start", "--broker", "log", "--poll-interval", "100ms", env=renv) as proc:
        try:
            assert wait_until(lambda: bool(proc.stdout().strip()), timeout=30), proc.tail()
        finally:
            proc.stop()
        out, err = proc.stdout(), proc.stderr()
    assert proc.returncode == 0, err
    assert json.loads(out)["outbox_id"] == oid


def test_relay_migrate_grants_the_roles_it_is_given(pg_dsn: str, other_roles: tuple[str, str]) -> None:
    producer, relay = other_roles
    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        done = run_relay(
            "migrate", "--dsn", pg_dsn, "--schema", schema, "--grant-producer", producer, "--grant-relay", relay
        )
        assert done.returncode == 0, done.stderr
        assert f"granted producer privileges to role {producer!r}" in done.stdout
        names = OutboxNames(schema=schema)
        with psycopg.connect(dsn_as(pg_dsn, producer)) as conn:
            _insert(conn, names, "o-1", "OrderPlaced")
            conn.commit()
        status = run_relay("status", "--dsn", dsn_as(pg_dsn, relay), "--schema", schema, "--json")
        assert status.returncode == 0, status.stderr
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--grant-producer", "no_such_role_anywhere"], "no such role"),
        (["--grant-relay", ""], "empty role name"),
        (["--grant-relay", "r" * 64], "longer than 63 bytes"),
        (["--grant-producer", "bad\nrole"], "control characters"),
        (["--grant-producer", 'x"; DROP TABLE outbox; --'], "no such role"),
        ([], "no role given"),
    ],
)
def test_bad_roles_get_one_line_and_exit_2(pg_dsn: str, names: OutboxNames, args: list[str], needle: str) -> None:
    env = relay_env(RELAY_DSN=pg_dsn, RELAY_SCHEMA=names.schema)
    assert_one_line_error(run_relay("grants", *args, env=env), needle)
    if args:
        assert_one_line_error(run_relay("migrate", *args, env=env), needle)


def test_migrate_with_a_missing_role_changes_nothing(pg_dsn: str) -> None:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", schema, "--grant-relay", "no_such_role_anywhere")
    assert_one_line_error(proc, "no such role")
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT to_regnamespace(%s)", (schema,)).fetchone() == (None,)


async def test_concurrent_grants_on_one_database_all_land(pg_dsn: str, other_roles: tuple[str, str]) -> None:
    """Deployers granting at once (two services' `relay migrate --grant-relay` on one database)
    each update the database's privileges; unserialized, PostgreSQL fails all but one with
    "tuple concurrently updated". Every grant lands, and every role can use its outbox."""
    producer, relay = other_roles
    outboxes = [OutboxNames(schema=f"cg_{uuid.uuid4().hex[:10]}", table="outbox") for _ in range(6)]
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        for names in outboxes:
            await migrate(conn, names)
    try:
        conns = [await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) for _ in outboxes]
        try:
            chosen = [Grantee("producer", producer), Grantee("relay", relay)]
            results = await asyncio.gather(
                *(grant(c, names, chosen) for c, names in zip(conns, outboxes, strict=True)), return_exceptions=True
            )
        finally:
            for c in conns:
                await c.close()
        assert [r for r in results if isinstance(r, BaseException)] == []
        for names in outboxes:
            with psycopg.connect(dsn_as(pg_dsn, relay)) as conn:
                conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(names.schema, names.table)))
    finally:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            for names in outboxes:
                await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(names.schema)))
