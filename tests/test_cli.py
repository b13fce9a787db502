"""The `relay` command line, run as a real process against a real PostgreSQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from relay.db.statements import migrations
from tests.conftest import Db
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until


@pytest.fixture
def fresh_schema(pg_dsn: str) -> Iterator[str]:
    schema = f"cli_{uuid.uuid4().hex[:10]}"
    yield schema
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_migrate_is_idempotent_and_records_what_it_applied(pg_dsn: str, fresh_schema: str) -> None:
    first = run_relay("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert first.returncode == 0, first.stderr
    assert f"{fresh_schema}.outbox: applied 0001_outbox" in first.stdout
    second = run_relay("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT version, name FROM {}").format(sql.Identifier(fresh_schema, "outbox_migrations"))
        ).fetchall()
    assert rows == [(v, n) for v, n, _ in migrations()]


def test_migrate_says_each_migration_once(pg_dsn: str, fresh_schema: str) -> None:
    """One line per migration on stdout, and no second copy of each in the log (stderr)."""
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert proc.returncode == 0, proc.stderr
    labels = [f"{v:04d}_{n}" for v, n, _ in migrations()]
    assert proc.stdout.splitlines() == [f"{fresh_schema}.outbox: applied {label}" for label in labels]
    output = proc.stdout + proc.stderr
    assert [output.count(label) for label in labels] == [1] * len(labels), proc.stderr


def test_concurrent_migrations_apply_once(pg_dsn: str, fresh_schema: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: run_relay("migrate", "--dsn", pg_dsn, "--schema", fresh_schema), range(4)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert sum("applied 0001_outbox" in r.stdout for r in results) == 1
    with psycopg.connect(pg_dsn) as conn:
        [(count,)] = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(fresh_schema, "outbox_migrations"))
        ).fetchall()
    assert count == len(migrations())


def test_start_drains_the_outbox_with_several_workers_and_stops_on_sigterm(
    pg_dsn: str, relay_dsn: str, db: Db, tmp_path: Path
) -> None:
    ids = db.insert((f"order-{i % 20}", "OrderPlaced" if i % 3 else "EmailQueued", {"i": i}) for i in range(300))
    config = tmp_path / "relay.toml"
    config.write_text(
        f'schema = "{db.names.schema}"\nworkers = 3\nbatch_size = 25\npoll_interval = "100ms"\n'
        '[ordering]\ndefault = "unordered"\nordered = ["Order*"]\n'
    )
    with RelayProcess("start", "--config", str(config), "--broker", "log", env=relay_env(RELAY_DSN=relay_dsn)) as proc:
        try:
            wait_until(lambda: db.statuses().get("done", 0) >= 300, timeout=30)
        finally:
            proc.stop()
        out, err = proc.stdout(), proc.stderr()
    assert proc.returncode == 0, err
    assert db.statuses() == {"done": 300}
    lines = [json.loads(line) for line in out.splitlines()]
    assert sorted(line["outbox_id"] for line in lines) == ids  # each exactly once
    assert {line["lease_version"] for line in lines} == {1}
    by_order: dict[str, list[int]] = {}
    for line in lines:
        if line["event_type"] == "OrderPlaced":
            by_order.setdefault(line["aggregate_id"], []).append(line["outbox_id"])
    assert all(seq == sorted(seq) for seq in by_order.values())  # one writer: commit order is id order
    # The rows were written before any relay stored the map, so all were routed ordered
    # (the default): each carries its place in its aggregate, in delivery order.
    routed = {r["id"]: r["ordered"] for r in db.rows()}
    assert all(routed.values())
    seqs: dict[str, list[int]] = {}
    for line in lines:
        seqs.setdefault(line["aggregate_id"], []).append(line["aggregate_seq"])
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values())
    owners = {r["lease_owner"] for r in db.rows()}
    assert owners == {None}
    assert "relay started: 3 workers, broker log" in err
    assert "stopping" in err


def test_the_retired_commit_order_guard_still_starts_with_one_warning(
    pg_dsn: str, relay_dsn: str, db: Db, tmp_path: Path
) -> None:
    [oid] = db.insert([("order-1", "OrderPlaced", {})])
    config = tmp_path / "relay.toml"
    config.write_text(f'schema = "{db.names.schema}"\ncommit_order_guard = false\npoll_interval = "100ms"\n')
    with RelayProcess(
        "start",
        "--config",
        str(config),
        "--broker",
        "log",
        "--no-commit-order-guard",
        env=relay_env(RELAY_DSN=relay_dsn),
    ) as proc:
        try:
            wait_until(lambda: db.statuses() == {"done": 1}, timeout=20)
        finally:
            proc.stop()
        out, err = proc.stdout(), proc.stderr()
    assert proc.returncode == 0, err
    assert json.loads(out)["outbox_id"] == oid
    assert err.count("is deprecated and has no effect") == 1, err


def test_start_refuses_an_outbox_migrated_by_a_newer_release_or_not_fully(pg_dsn: str, relay_dsn: str, db: Db) -> None:
    ledger = sql.Identifier(db.names.schema, "outbox_migrations")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("INSERT INTO {} VALUES (999, 'from_the_future')").format(ledger))
        newer = run_relay("start", "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "log")
        assert_one_line_error(newer, "has migration 0999, newer than this relay knows", "upgrade outbox-relay")
        conn.execute(sql.SQL("DELETE FROM {} WHERE version IN (4, 999)").format(ledger))
        older = run_relay("start", "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "log")
        assert_one_line_error(older, "lacks migration 0004_aggregate_seq", "relay migrate")


def test_start_refuses_an_outbox_that_was_never_migrated(relay_dsn: str) -> None:
    proc = run_relay("start", "--dsn", relay_dsn, "--schema", "never_migrated_here", "--broker", "log")
    assert_one_line_error(proc, "never_migrated_here.outbox is not set up", "relay migrate")


def test_unreachable_database_is_named_and_the_password_masked() -> None:
    dsn = "postgresql://alice:s3cretpw@127.0.0.1:1/orders"
    for command in (["migrate"], ["start", "--broker", "log"]):
        proc = run_relay(*command, "--dsn", dsn)
        assert_one_line_error(proc, "cannot connect to PostgreSQL at host 127.0.0.1:1 database 'orders'")
        assert "s3cretpw" not in proc.stderr + proc.stdout


def test_an_unreachable_two_host_dsn_names_each_host_with_its_port() -> None:
    proc = run_relay("status", "--dsn", "postgresql://alice:s3cretpw@127.0.0.1:1,127.0.0.1:2/orders")
    assert_one_line_error(proc, "cannot connect to PostgreSQL at hosts 127.0.0.1:1,127.0.0.1:2 database 'orders'")
    assert "s3cretpw" not in proc.stderr + proc.stdout


def test_password_in_keyword_dsn_never_printed() -> None:
    proc = run_relay("migrate", "--dsn", "host=127.0.0.1 port=1 dbname=x user=bob password=hunter22")
    assert_one_line_error(proc, "host 127.0.0.1:1")
    assert "hunter22" not in proc.stderr


def test_malformed_dsn() -> None:
    proc = run_relay("migrate", "--dsn", "this is = not 'a dsn")
    err = assert_one_line_error(proc, "invalid --dsn")
    assert "not 'a dsn" not in err


@pytest.mark.parametrize(
    ("args", "contents", "needles"),
    [
        (["--config", "/nonexistent/relay.toml"], None, ["config file not found: /nonexistent/relay.toml"]),
        (["--config", "{cfg}"], "workers = [", ["malformed config file"]),
        (["--config", "{cfg}"], "wokers = 3\n", ["unknown key 'wokers'"]),
        (["--config", "{cfg}"], "[ordering]\nordred = []\n", ["unknown key 'ordred' in [ordering]"]),
        (["--lease", "5 fortnights"], None, ["invalid --lease", "5 fortnights"]),
        (["--lease", "10s", "--publish-timeout", "20s"], None, ["must end inside --lease"]),
        (["--workers", "-1"], None, ["invalid --workers"]),
        (["--table", "Robert'); DROP TABLE students;--"], None, ["invalid table name"]),
        ([], None, ["no broker chosen"]),
        (["--broker", "kafak"], None, ["invalid --broker: 'kafak'"]),
        (["--no-such-flag"], None, ["No such option '--no-such-flag'"]),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(
    tmp_path: Path, args: list[str], contents: str | None, needles: list[str]
) -> None:
    cfg = tmp_path / "relay.toml"
    if contents is not None:
        cfg.write_text(contents)
    args = [a.replace("{cfg}", str(cfg)) for a in args]
    if "--broker" not in args and "no broker chosen" not in needles:
        args += ["--broker", "log"]
    proc = run_relay("start", "--dsn", "postgresql://127.0.0.1:1/x", *args)
    assert_one_line_error(proc, *needles)


def test_no_dsn_anywhere() -> None:
    assert_one_line_error(run_relay("migrate"), "no database given")


def test_env_and_config_feed_the_same_options(pg_dsn: str, fresh_schema: str, tmp_path: Path) -> None:
    cfg = tmp_path / "relay.toml"
    cfg.write_text(f'dsn = "{pg_dsn}"\nschema = "{fresh_schema}"\n')
    assert run_relay("migrate", env=relay_env(RELAY_CONFIG=str(cfg))).returncode == 0
    # The environment beats the file: RELAY_SCHEMA names a schema the file does not.
    other = fresh_schema + "_env"
    try:
        proc = run_relay("migrate", "--config", str(cfg), env=relay_env(RELAY_SCHEMA=other))
        assert f"{other}.outbox: applied" in proc.stdout, proc.stderr
        # ...and the command line beats the environment.
        proc = run_relay("migrate", "--config", str(cfg), "--schema", fresh_schema, env=relay_env(RELAY_SCHEMA=other))
        assert f"{fresh_schema}.outbox: up to date" in proc.stdout
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(other)))


def test_migrate_can_store_the_ordering_map_before_any_relay_starts(pg_dsn: str, fresh_schema: str) -> None:
    proc = run_relay(
        "migrate", "--dsn", pg_dsn, "--schema", fresh_schema, "--ordering-default", "unordered", "--ordered", "Order*"
    )
    assert proc.returncode == 0, proc.stderr
    assert "ordering map stored: default=unordered ordered=['Order*']" in proc.stdout
    table = sql.Identifier(fresh_schema, "outbox")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " VALUES ('order', 'o1', 'OrderPlaced', '{{}}'), ('order', 'o1', 'EmailQueued', '{{}}')"
            ).format(table)
        )
        routed = conn.execute(sql.SQL("SELECT event_type, ordered FROM {} ORDER BY id").format(table)).fetchall()
    assert routed == [("OrderPlaced", True), ("EmailQueued", False)]
    # Without ordering options, migrate leaves the stored map alone.
    again = run_relay("migrate", "--dsn", pg_dsn, "--schema", fresh_schema)
    assert "ordering map stored" not in again.stdout
    with psycopg.connect(pg_dsn) as conn:
        [(default,)] = conn.execute(
            sql.SQL("SELECT ord_default FROM {}").format(sql.Identifier(fresh_schema, "outbox_settings"))
        ).fetchall()
    assert default is False
