"""Push wake-ups: an insert wakes an idle relay long before its poll interval, and only an
idle one: while a relay works, its producers send no NOTIFY (which would serialize their
commits on a database-wide lock)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.ordering import OrderingMap
from relay.runner import run_relay
from relay.testing import InMemoryPublisher
from relay.wakeup import LISTENER_TTL
from tests.conftest import Db
from tests.helpers import record_listeners, settings_for
from tests.relay_process import RelayProcess, relay_env, wait_until_async


async def _latency(relay_dsn: str, names: OutboxNames, db: Db, *, notify: bool) -> float:
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=2, poll_interval=timedelta(seconds=3), notify=notify)
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    try:
        await asyncio.sleep(0.5)  # both workers have found nothing and gone idle
        started = time.monotonic()
        db.insert([("a", "E", {})])
        assert await wait_until_async(lambda: len(publisher.delivered) == 1, timeout=10)
        return time.monotonic() - started
    finally:
        stop.set()
        await task


async def test_insert_wakes_idle_workers(relay_dsn: str, names: OutboxNames, db: Db) -> None:
    assert await _latency(relay_dsn, names, db, notify=True) < 1.0  # the poll interval is 3 s


async def test_without_notify_polling_still_delivers(relay_dsn: str, names: OutboxNames, db: Db) -> None:
    latency = await _latency(relay_dsn, names, db, notify=False)
    assert 0.3 < latency < 5  # found by the 3 s poll, not woken at once
    [(notify,)] = db.conn.execute(f'SELECT notify FROM "{names.schema}".outbox_settings').fetchall()
    assert notify is True  # one process's choice: the producers' trigger and other relays are untouched


# ---- helpers: the channel as a test hears it, the listeners table, a relay subprocess


@contextlib.asynccontextmanager
async def listening(pg_dsn: str, names: OutboxNames) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection of the test's own that LISTENs on the outbox's wake-up channel (as the
    superuser: an observer, neither producer nor relay; LISTEN takes no privilege)."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(f"{names.schema}.{names.table}")))
        yield conn


async def heard(conn: psycopg.AsyncConnection[Any], seconds: float, *, stop_after: int | None = None) -> int:
    """How many notifications arrive within ``seconds`` (those already queued too), or
    ``stop_after`` as soon as that many have."""
    return len([n async for n in conn.notifies(timeout=seconds, stop_after=stop_after)])


def listeners(db: Db) -> list[tuple[str, bool, bool]]:
    """(owner, idle, live) of every row in <table>_listeners."""
    table = sql.Identifier(db.names.schema, f"{db.names.table}_listeners")
    cur = db.conn.execute(sql.SQL("SELECT owner, idle, expires_at > now() FROM {} ORDER BY owner").format(table))
    return [(str(o), bool(i), bool(live)) for o, i, live in cur.fetchall()]


def live_states(db: Db) -> list[bool]:
    return [idle for _, idle, live in listeners(db) if live]


async def until(predicate: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout:g}s"
        await asyncio.sleep(0.05)


def count(db: Db, status: str) -> int:
    cur = db.conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE status = %s").format(db.table), (status,))
    row = cur.fetchone()
    assert row is not None
    return int(row[0])


@contextlib.contextmanager
def relay_process(relay_dsn: str, names: OutboxNames, *args: str) -> Iterator[RelayProcess]:
    """`relay start --broker log` as a subprocess as ``relay_dsn`` (its JSON lines to
    /dev/null); stopped with SIGTERM at the end unless the test killed it."""
    argv = ["start", "--schema", names.schema, "--table", names.table, "--broker", "log", *args]
    with RelayProcess(*argv, env=relay_env(RELAY_DSN=relay_dsn), discard_stdout=True) as proc:
        try:
            yield proc
        except BaseException:
            print("relay log tail:\n" + proc.tail(30))
            raise
        finally:
            proc.stop()


# ---- an idle relay is woken; a working one draws no NOTIFY


async def test_an_idle_relay_is_woken_well_inside_a_long_poll_interval(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=2, poll_interval=timedelta(seconds=30))
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    try:
        await until(lambda: live_states(db) == [True], what="the relay's idle row")
        for n in range(1, 4):  # idle again after each delivery, and woken again each time
            started = time.monotonic()
            db.insert([("a", "E", {"n": n})])
            assert await wait_until_async(lambda n=n: len(publisher.delivered) == n, timeout=2)  # type: ignore[misc]
            assert time.monotonic() - started < 2  # the poll interval is 30 s
            await until(lambda: live_states(db) == [True], what="idle again")
    finally:
        stop.set()
        await task
    assert listeners(db) == []  # a relay that stops removes its row


async def test_a_working_relay_draws_no_notify_from_its_producers(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """The reproduction: every insert used to NOTIFY while notify was on, whatever the relay
    was doing. A relay draining a backlog is working; producers inserting meanwhile must not
    notify, and must again once it is idle."""
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:  # relay settings set
        await store_ordering(conn, names, OrderingMap(default_ordered=False))
    # Batches of 10 over 2 workers, not growing with the backlog: the log broker drains a
    # few thousand a second here, so 40,000 rows keep the relay busy for several seconds.
    backlog = 40_000
    with relay_process(
        relay_dsn, names, "--workers", "2", "--batch-size", "10", "--max-batch-size", "10", "--poll-interval", "30s"
    ):
        async with listening(pg_dsn, names) as channel:
            # Idle first: an insert is heard and delivered.
            await until(lambda: live_states(db) == [True], what="the relay's idle row")
            db.insert([("probe", "E", {})])
            assert await heard(channel, 2, stop_after=1) == 1
            await until(lambda: count(db, "done") == 1, what="the probe's delivery")
            await until(lambda: live_states(db) == [True], what="idle again")

            # One statement writes the backlog (one wake-up); the relay starts on it.
            db.conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', 'b-' || i %% 500, 'E', '{{}}' FROM generate_series(1, %s) AS i"
                ).format(db.table),
                (backlog,),
            )
            await until(lambda: count(db, "done") > 1 + 100, what="the relay working on the backlog")
            await heard(channel, 0.3)  # the backlog's own wake-up, sent while the relay was idle

            # The busy window: single-row producer transactions, and not one NOTIFY.
            for i in range(60):
                db.insert([(f"live-{i}", "E", {"i": i})])
                await asyncio.sleep(0.02)
            assert await heard(channel, 0.5) == 0
            assert count(db, "pending") > 0  # the relay was still working through the window
            assert live_states(db) == [False]

            # The rest of the backlog is deleted (by hand, as an operator may): the relay runs
            # out of work, goes idle, and the next insert is heard and delivered.
            db.conn.execute(sql.SQL("DELETE FROM {} WHERE status = 'pending'").format(db.table))
            await until(lambda: count(db, "processing") == 0, what="the batches in hand finished")
            done = count(db, "done")
            await until(lambda: live_states(db) == [True], what="idle after the backlog")
            db.insert([("after", "E", {})])
            assert await heard(channel, 2, stop_after=1) == 1
            await until(lambda: count(db, "done") == done + 1, timeout=2, what="delivery after the backlog")


async def test_a_killed_idle_relay_stops_drawing_notifies_once_its_row_expires(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """The reproduction: producers notified for as long as notify was on, whether or not any
    relay was there to hear it."""
    with relay_process(relay_dsn, names, "--workers", "2", "--poll-interval", "30s") as proc:
        async with listening(pg_dsn, names) as channel:
            await until(lambda: live_states(db) == [True], what="the relay's idle row")
            db.insert([("a", "E", {})])
            assert await heard(channel, 2, stop_after=1) == 1
            await until(lambda: count(db, "done") == 1, what="delivery")
            await until(lambda: live_states(db) == [True], what="idle again")

            proc.kill()  # no shutdown: its row stays behind
            assert [idle for _, idle, _ in listeners(db)] == [True]
            await until(lambda: live_states(db) == [], timeout=LISTENER_TTL.total_seconds() + 2, what="expiry")

            await heard(channel, 0)
            db.insert([("b", "E", {})])
            assert await heard(channel, 1) == 0


async def test_a_relay_that_does_not_listen_never_says_it_is_idle(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """`relay start --no-notify` (behind a transaction-mode pooler) polls: it hears no
    wake-up, so producers must not send it one."""
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=2, poll_interval=timedelta(milliseconds=100), notify=False)
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    try:
        async with listening(pg_dsn, names) as channel:
            db.insert([("a", "E", {})])
            assert await wait_until_async(lambda: len(publisher.delivered) == 1, timeout=5)  # it runs, and polls
            await asyncio.sleep(0.3)  # its workers have found nothing since
            db.insert([("b", "E", {})])
            assert await heard(channel, 1) == 0
            assert listeners(db) == []
            assert await wait_until_async(lambda: len(publisher.delivered) == 2, timeout=5)
    finally:
        stop.set()
        await task


# ---- going idle: the mark, then one more look


async def test_a_row_committed_while_the_relay_marks_itself_idle_is_not_left_for_the_poll(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """A row that commits after the workers' last empty claim but before their process's
    idle row does sends no wake-up (its producer saw no idle relay). The relay must look for
    work once more after the mark, or that row waits for the poll interval (30 s here).

    The window is held open for real: the test locks the listeners table against writes,
    so the relay's idle mark waits, and the producer commits while it does."""
    listeners_table = sql.Identifier(names.schema, f"{names.table}_listeners")
    publisher = InMemoryPublisher()
    stop = asyncio.Event()
    settings = settings_for(relay_dsn, names, workers=2, poll_interval=timedelta(seconds=30))
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        with holder.transaction():
            # Readers (the producers' trigger) pass; the relay's INSERT ... ON CONFLICT waits.
            holder.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(listeners_table))
            task = asyncio.create_task(run_relay(settings, publisher, stop))
            try:
                await until(lambda: _mark_waiting(db), what="the relay's idle mark waiting for the lock")
                db.insert([("a", "E", {})])  # committed; no relay is idle yet, so no wake-up
            except BaseException:
                stop.set()
                raise
        # The lock is gone: the mark commits, and the row is found at once, not in 30 s.
        try:
            assert await wait_until_async(lambda: len(publisher.delivered) == 1, timeout=2)
        finally:
            stop.set()
            await task


def _mark_waiting(db: Db) -> bool:
    return _waiting_for_lock(db, "_listeners") > 0


def _waiting_for_lock(db: Db, suffix: str) -> int:
    """Sessions of this database waiting for a lock in a statement on ``<table><suffix>``."""
    cur = db.conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND wait_event_type = 'Lock' AND query LIKE %s",
        # Schema-qualified: other tests' outboxes (running beside this one) are all "outbox".
        (f'%"{db.names.schema}"."{db.names.table}{suffix}"%',),
    )
    row = cur.fetchone()
    return int(row[0]) if row else 0


# ---- the producers' check, row by row


@pytest.mark.parametrize(
    ("rows", "notifies"),
    [
        ([], False),  # no relay listening: nobody to wake
        ([("r:1", True, "1 hour")], True),  # one idle relay
        ([("r:1", True, "1 hour"), ("r:2", True, "1 hour")], True),
        ([("r:1", True, "1 hour"), ("r:2", False, "1 hour")], False),  # one working: it claims the row anyway
        ([("r:1", False, "1 hour")], False),
        ([("r:1", True, "-1 second")], False),  # a killed idle relay's row, expired
        ([("r:1", True, "1 hour"), ("r:2", False, "-1 second")], True),  # a killed working one no longer counts
    ],
)
async def test_producers_notify_only_while_every_live_relay_is_idle(
    pg_dsn: str, names: OutboxNames, db: Db, rows: list[tuple[str, bool, str]], notifies: bool
) -> None:
    record_listeners(db.conn, names, rows)
    async with listening(pg_dsn, names) as channel:
        db.insert([("a", "E", {}), ("b", "E", {})])  # one transaction
        assert await heard(channel, 1) == (1 if notifies else 0)


async def test_two_relays_changing_state_at_once_leave_the_answer_their_rows_give(
    pg_dsn: str, names: OutboxNames, db: Db, store: OutboxStore
) -> None:
    """Relay A goes from idle to working while relay B goes from working to idle: the
    answer the producers read must end as "do not notify" (A works). Each relay recomputes
    it from the rows; computed on a snapshot from before the other's change committed, B
    would still see A idle and leave "notify" behind.

    The race is held open for real: the test holds the settings row's lock, A's change
    queues on it first and B's behind it, then the lock goes."""
    record_listeners(db.conn, names, [("a:1", True, "1 hour"), ("b:1", False, "1 hour")])
    settings_table = sql.Identifier(names.schema, f"{names.table}_settings")
    hour = timedelta(hours=1)
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        with holder.transaction():
            holder.execute(sql.SQL("SELECT 1 FROM {} FOR UPDATE").format(settings_table))
            a = asyncio.create_task(store.set_listener("a:1", idle=False, ttl=hour))
            await until(lambda: _waiting_for_lock(db, "_settings") == 1, what="A's change waiting for the lock")
            b = asyncio.create_task(store.set_listener("b:1", idle=True, ttl=hour))
            await until(lambda: _waiting_for_lock(db, "_settings") == 2, what="B's change waiting behind A's")
        await asyncio.gather(a, b)
    assert live_states(db) == [False, True]
    async with listening(pg_dsn, names) as channel:
        db.insert([("x", "E", {})])
        assert await heard(channel, 1) == 0
    await store.set_listener("a:1", idle=True, ttl=hour)  # now both idle: the producers notify
    async with listening(pg_dsn, names) as channel:
        db.insert([("x", "E", {})])
        assert await heard(channel, 2, stop_after=1) == 1


async def test_the_answer_runs_out_with_a_killed_idle_relays_row(pg_dsn: str, names: OutboxNames, db: Db) -> None:
    """Nobody recomputes the answer for a relay that was killed while idle: it must lapse
    by itself when that relay's row does, or its producers would go on notifying nobody."""
    record_listeners(db.conn, names, [("gone:1", True, "1 second")])
    async with listening(pg_dsn, names) as channel:
        db.insert([("a", "E", {})])
        assert await heard(channel, 2, stop_after=1) == 1
        await asyncio.sleep(1.2)
        db.insert([("a", "E", {})])
        assert await heard(channel, 1) == 0
