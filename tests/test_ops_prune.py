"""`relay prune` against a real PostgreSQL: what it deletes, what it keeps, and in how many batches."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql

from relay.errors import ConfigError
from relay.retention import prune
from tests.conftest import Db
from tests.ops_helpers import run_parallel, target
from tests.relay_process import assert_one_line_error


def arrange(db: Db) -> list[int]:
    """40 rows, laid out along the primary key for chunks of 5:

    ids  1-20  done 9 days ago                 (go)
    ids 21-22  dead and unordered, written 10 days ago (kept unless --include-dead)
    ids 23-25  pending, written 10 days ago     (never touched)
    ids 26-30  written 10 days ago, done 1 hour ago (kept: finished recently)
    ids 31-40  written and done just now        (kept; the walk stops at the first such chunk)
    """
    ids = db.insert([(f"agg-{i % 7}", "OrderPlaced", {"i": i}) for i in range(40)])

    def update(span: slice, assignments: str) -> None:
        db.conn.execute(sql.SQL("UPDATE {} SET " + assignments + " WHERE id = ANY(%s)").format(db.table), (ids[span],))

    update(
        slice(0, 20), "status = 'done', created_at = now() - interval '10 days', done_at = now() - interval '9 days'"
    )
    update(slice(20, 22), "status = 'dead', ordered = false, created_at = now() - interval '10 days', last_error = 'x'")
    update(slice(22, 25), "created_at = now() - interval '10 days'")
    update(
        slice(25, 30), "status = 'done', created_at = now() - interval '10 days', done_at = now() - interval '1 hour'"
    )
    update(slice(30, 40), "status = 'done', done_at = now()")
    return ids


async def test_prune_deletes_old_done_rows_in_batches_and_stops_early(db: Db, relay_dsn: str) -> None:
    ids = arrange(db)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        dry = await prune(conn, db.names, timedelta(days=7), batch=5, dry_run=True)
        assert (dry.done, dry.dead, dry.batches, dry.dry_run) == (20, 0, 7, True)
        assert len(db.rows()) == 40  # a dry run deletes nothing

        result = await prune(conn, db.names, timedelta(days=7), batch=5)
        # Seven statements: four chunks of old done rows, two of rows it keeps, and the
        # first chunk written after the cutoff, where it stops: ids 36-40 are never read.
        assert (result.done, result.dead, result.batches, result.scanned) == (20, 0, 7, 35)
        assert result.last_id == ids[34]
        assert [r["id"] for r in db.rows()] == ids[20:]
        assert {r["id"]: r["status"] for r in db.rows("status <> 'done'")} == {
            **dict.fromkeys(ids[20:22], "dead"),
            **dict.fromkeys(ids[22:25], "pending"),
        }

        again = await prune(conn, db.names, timedelta(days=7), batch=5)
        assert again.deleted == 0

        with_dead = await prune(conn, db.names, timedelta(days=7), batch=5, include_dead=True)
        assert (with_dead.done, with_dead.dead, with_dead.batches) == (0, 2, 3)
        assert [r["id"] for r in db.rows()] == ids[22:]

        recent = await prune(conn, db.names, timedelta(minutes=30), batch=100)
        assert recent.done == 5  # ids 26-30, done an hour ago
        assert [r["id"] for r in db.rows()] == ids[22:25] + ids[30:]

        with pytest.raises(ConfigError, match="must not be negative"):
            await prune(conn, db.names, timedelta(seconds=-1))
        with pytest.raises(ConfigError, match="batch size"):
            await prune(conn, db.names, timedelta(days=1), batch=0)


async def test_prune_keeps_a_dead_row_redriven_while_it_ran(db: Db, relay_dsn: str) -> None:
    """The delete re-checks each row as it is once its lock is free: a dead row re-driven
    by a transaction that commits while prune waits for it is kept."""
    [oid] = db.insert([("a", "OrderPlaced", {})])
    db.conn.execute(
        sql.SQL(
            "UPDATE {} SET status = 'dead', ordered = false, created_at = now() - interval '10 days' WHERE id = %s"
        ).format(db.table),
        (oid,),
    )
    async with (
        await psycopg.AsyncConnection.connect(relay_dsn) as operator,
        await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn,
    ):
        await operator.execute(
            sql.SQL("UPDATE {} SET status = 'pending' WHERE id = %s").format(db.table), (oid,)
        )  # uncommitted: holds the row lock
        task = asyncio.create_task(prune(conn, db.names, timedelta(days=1), include_dead=True))
        await asyncio.sleep(0.5)
        assert not task.done()  # waiting for the operator's row lock
        await operator.commit()
        result = await asyncio.wait_for(task, 10)
    assert result.deleted == 0
    assert db.row(oid)["status"] == "pending"


def test_prune_cli(db: Db, relay_dsn: str) -> None:
    ids = arrange(db)
    t = target(relay_dsn, db)
    dry, missing, bad, chunk = run_parallel(
        ["prune", *t, "--older-than", "7d", "--chunk-size", "5", "--dry-run"],
        ["prune", *t],
        ["prune", *t, "--older-than", "5 fortnights"],
        ["prune", *t, "--older-than", "7d", "--chunk-size", "0"],
    )
    assert dry.returncode == 0, dry.stderr
    assert "dry run:" in dry.stdout and "would delete 20 done rows" in dry.stdout
    assert "7 batches, 35 rows read" in dry.stdout and "nothing changed" in dry.stdout
    assert_one_line_error(missing, "needs --older-than")
    assert_one_line_error(bad, "invalid --older-than", "5 fortnights")
    assert_one_line_error(chunk, "--chunk-size")
    assert len(db.rows()) == 40

    [real] = run_parallel(["prune", *t, "--older-than", "7d", "--include-dead", "--json"])
    assert real.returncode == 0, real.stderr
    out = json.loads(real.stdout)
    assert (out["done"], out["dead"], out["deleted"], out["dry_run"]) == (20, 2, 22, False)
    assert [r["id"] for r in db.rows()] == ids[22:]
