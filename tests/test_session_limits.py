"""Session hygiene: PostgreSQL itself ends what a relay session holds too long, a statement
past --statement-timeout and a transaction idle past --idle-in-transaction-timeout, so a
relay bug or a stuck network cannot hold locks or the xmin horizon (relay.db.SessionLimits)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.config import CORE_OPTIONS, START_OPTIONS, session_limits
from relay.db.dispatch import OutboxStore
from relay.db.session import TRANSIENT_DB_ERRORS, SessionLimits, configure_session, open_pool
from relay.options import resolve
from tests.conftest import Db
from tests.helpers import make_worker, settings_for
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until, wait_until_async

SHORT = SessionLimits(
    statement_timeout=timedelta(milliseconds=300), idle_in_transaction_timeout=timedelta(milliseconds=500)
)


async def _shown(conn: psycopg.AsyncConnection[Any]) -> tuple[str, str]:
    cur = await conn.execute(
        "SELECT current_setting('statement_timeout'), current_setting('idle_in_transaction_session_timeout')"
    )
    row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


async def test_the_relays_sessions_get_the_default_limits(relay_dsn: str) -> None:
    pool = await open_pool(relay_dsn, size=1)
    try:
        async with pool.connection() as conn:
            assert await _shown(conn) == ("30s", "10s")
    finally:
        await pool.close()


async def test_a_statement_past_the_timeout_is_cancelled(relay_dsn: str) -> None:
    pool = await open_pool(relay_dsn, size=1, limits=SHORT)
    try:
        async with pool.connection() as conn:
            assert await _shown(conn) == ("300ms", "500ms")
            started = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                await conn.execute("SELECT pg_sleep(5)")
            assert time.monotonic() - started < 2.5
            await conn.execute("SELECT 1")  # the session itself lives on
    finally:
        await pool.close()


async def test_a_session_idle_in_a_transaction_past_the_timeout_is_ended(relay_dsn: str, db: Db, pg_dsn: str) -> None:
    [oid] = db.insert([("o-1", "OrderPlaced", {})])
    pool = await open_pool(relay_dsn, size=1, limits=SHORT)
    try:
        async with pool.connection() as conn:
            await conn.execute("BEGIN")
            # What a stuck relay would hold: a row lock (and a snapshot, the xmin horizon).
            await conn.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(db.table), (oid,))
            cur = await conn.execute("SELECT pg_backend_pid()")
            [(pid,)] = await cur.fetchall()
            await asyncio.sleep(1.5)
            with psycopg.connect(pg_dsn, autocommit=True) as admin:
                gone = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                assert gone == (0,)  # PostgreSQL ended the session
                # and its lock with it: another session takes the row at once.
                admin.execute("SET lock_timeout = '1s'")
                admin.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(db.table), (oid,))
            # What the dispatch path retries as a lost session (relay.db.TRANSIENT_DB_ERRORS).
            with pytest.raises(TRANSIENT_DB_ERRORS):
                await conn.execute("SELECT 1")
    finally:
        await pool.close()


async def test_zero_turns_a_limit_off(relay_dsn: str) -> None:
    off = SessionLimits(statement_timeout=timedelta(0), idle_in_transaction_timeout=timedelta(0))
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        await configure_session(conn, off)
        assert await _shown(conn) == ("0", "0")


def test_the_options_reach_the_settings(pg_dsn: str, names: Any) -> None:
    settings = settings_for(
        pg_dsn, names, statement_timeout=timedelta(minutes=2), idle_in_transaction_timeout=timedelta(seconds=3)
    )
    assert settings.session == SessionLimits(timedelta(minutes=2), timedelta(seconds=3))
    defaults = resolve((*CORE_OPTIONS, *START_OPTIONS), {}, {}, {})
    assert session_limits(defaults) == SessionLimits()
    assert settings_for(pg_dsn, names).session == SessionLimits()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--statement-timeout", "2d"], "--statement-timeout"),
        (["--statement-timeout", "-1s"], "--statement-timeout"),
        (["--idle-in-transaction-timeout", "25h"], "--idle-in-transaction-timeout"),
    ],
)
def test_out_of_bounds_limits_are_refused(pg_dsn: str, args: list[str], needle: str) -> None:
    assert_one_line_error(run_relay("start", "--dsn", pg_dsn, "--broker", "log", *args), needle)


def test_relay_start_runs_its_sessions_with_the_given_statement_timeout(db: Db, relay_dsn: str) -> None:
    """A relay whose statement waits on a lock someone else holds is cancelled after
    --statement-timeout, says so, and goes on once the lock is gone."""
    [oid] = db.insert([("o-1", "OrderPlaced", {})])
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_SCHEMA=db.names.schema)
    args = ("start", "--broker", "log", "--poll-interval", "100ms", "--no-notify", "--statement-timeout", "400ms")
    with psycopg.connect(db.conn.info.dsn) as holder:
        # The ingest's counter row: every ordered row is numbered under it, by one relay at a time.
        holder.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(db.table))
        with RelayProcess(*args, env=env) as proc:
            try:
                assert wait_until(lambda: "statement timeout" in proc.stderr(), timeout=20), proc.tail()
                holder.rollback()
                assert wait_until(lambda: db.row(oid)["status"] == "done", timeout=20), proc.tail()
            finally:
                proc.stop()
            err = proc.stderr()
    assert proc.returncode == 0, err


def test_the_replay_plan_runs_without_the_statement_timeout(db: Db, relay_dsn: str) -> None:
    """The plan may scan much of a big table: it waits here behind a lock for longer than
    --statement-timeout and still completes; the replay's other statements keep the limit."""
    ids = db.insert([("o-1", "OrderPlaced", {}), ("o-2", "OrderPlaced", {})])
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'done'").format(db.table))
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_SCHEMA=db.names.schema)
    args = ("replay", "--from-id", str(ids[0]), "--broker", "log", "--dry-run", "--statement-timeout", "300ms")
    with psycopg.connect(db.conn.info.dsn) as holder:
        holder.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(db.table))
        with RelayProcess(*args, env=env) as proc:
            time.sleep(1.5)  # five times the statement timeout
            assert proc.running, proc.tail()
            holder.rollback()
            assert proc.wait(timeout=30) == 0, proc.tail()


class _StallOnce(OutboxStore):
    """The store, stalled once inside its claim transaction for longer than the idle limit:
    what a process starved of CPU or a blocked event loop does to an open transaction (the
    one stall injected; the timeout and the session's end are PostgreSQL's own)."""

    stalls = 1

    async def _ingest(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, bool]:
        result = await super()._ingest(conn)
        if self.stalls:
            self.stalls -= 1
            await asyncio.sleep(1.0)
        return result


async def test_a_worker_whose_transaction_was_ended_claims_again(db: Db, relay_dsn: str) -> None:
    [oid] = db.insert([("o-1", "OrderPlaced", {})])
    limits = SessionLimits(idle_in_transaction_timeout=timedelta(milliseconds=300))
    pool = await open_pool(relay_dsn, size=2, limits=limits)
    try:
        store = _StallOnce(pool, db.names, limits)
        worker, publisher = make_worker(store, backoff=None)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            assert await wait_until_async(lambda: db.row(oid)["status"] == "done" or running.done(), timeout=20)
        finally:
            stop.set()
            await asyncio.wait_for(running, timeout=10)  # raises what the loop raised, if anything
        assert store.stalls == 0
        assert db.row(oid)["status"] == "done"
        assert publisher.delivered_ids() == [oid]  # the ended transaction had claimed nothing
    finally:
        await pool.close()
