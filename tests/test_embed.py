"""The relay inside an application's event loop (relay.Relay, issue 38 item 11), against the
real PostgreSQL and RabbitMQ: entering it returns once it is connected and checked, or
raises why not; an error later is logged when it happens; cancelling the task that runs
it hands the rows in flight back and leaves no task, session or connection behind; and
two relays of two outboxes run side by side in one process."""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay import ConfigError, Relay
from relay.db.grants import Grantee, grant
from relay.db.names import OutboxNames
from relay.db.statements import schema_sql
from relay.errors import DatabaseUnavailable
from tests.conftest import Db, Roles
from tests.rabbitmq_broker import Rabbit, TcpProxy
from tests.relay_process import wait_until_async


def left_behind(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """The tasks that were not running before the relay and still run: none may be the
    relay's, nor of the libraries under it (psycopg_pool, aio-pika). The test's own (this
    one, the TCP proxy's) do not count."""
    current = asyncio.current_task()
    return [
        t
        for t in asyncio.all_tasks() - before
        if t is not current and not t.done() and not t.get_coro().__qualname__.startswith("TcpProxy.")
    ]


async def settle() -> None:
    """One turn of the loop for tasks cancelled in a ``finally`` to take their cancel."""
    for _ in range(3):
        await asyncio.sleep(0)


def relay_sessions(pg_dsn: str, role: str) -> int:
    """The relay role's sessions in PostgreSQL (each test run has its own roles). A backend
    leaves pg_stat_activity a moment after its client closed the connection: wait for it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = %s", (role,)).fetchone()
    assert row is not None
    return int(row[0])


def rabbit_relay(relay_dsn: str, names: OutboxNames, url: str, exchange: str, **more: Any) -> Relay:
    return Relay(
        dsn=relay_dsn,
        schema=names.schema,
        broker="rabbitmq",
        amqp_url=url,
        exchange=exchange,
        workers=2,
        poll_interval="100ms",
        **more,
    )


@pytest.fixture
async def second_outbox(pg_dsn: str, roles: Roles) -> AsyncIterator[Db]:
    """One more migrated outbox, as ``names`` makes it, for two relays side by side."""
    names = OutboxNames(schema=f"t_{uuid.uuid4().hex[:12]}", table="outbox")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        async with conn.transaction():
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
            await conn.execute(names.render(schema_sql()))
        await grant(conn, names, [Grantee("producer", roles.producer), Grantee("relay", roles.relay)])
    try:
        with (
            psycopg.connect(pg_dsn, autocommit=True) as owner,
            psycopg.connect(roles.producer_dsn, autocommit=True) as producer,
        ):
            yield Db(owner, names, producer)
    finally:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(names.schema)))


# ---- cancelling


async def test_cancelling_run_during_a_slow_publish_hands_the_rows_back_and_leaves_nothing_running(
    pg_dsn: str,
    relay_dsn: str,
    roles: Roles,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    proxy: TcpProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a framework's shutdown does: cancel the task running ``Relay.run()`` while the
    broker is slow to confirm. Before: 4-5 relay tasks ran on ("the pool 'relay' is already
    closed" in a loop), the batch stayed processing until its lease ran out, and a publish
    cut by the closed connection went to dead as an adapter bug."""
    caplog.set_level(logging.INFO)
    exchange = await rabbit.exchange("topic")
    await rabbit.queue(bind=(exchange, "#"))
    before = asyncio.all_tasks()
    relay = rabbit_relay(relay_dsn, names, proxy.url(rabbit.amqp.url), exchange)
    task = asyncio.create_task(relay.run())
    assert await wait_until_async(lambda: "relay started" in caplog.text, timeout=20), caplog.text
    proxy.latency = 5.0  # confirms now take 5 s: the publish is in flight when the cancel comes
    db.insert((f"order-{i}", "OrderPlaced", {"i": i}) for i in range(6))
    assert await wait_until_async(lambda: db.statuses() == {"processing": 6}, timeout=10), db.statuses()
    await asyncio.sleep(0.3)

    cancelled_at = asyncio.get_running_loop().time()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    took = asyncio.get_running_loop().time() - cancelled_at
    await settle()

    assert left_behind(before) == [], left_behind(before)
    # A second for the workers (runner.CANCEL_GRACE), then the broker connection's close,
    # whose channels answer through the 5 s latency too (each close gives up after 2 s):
    # about 3 s, never the 20 s publish timeout nor the 60 s lease.
    assert took < 8, f"the cancel took {took:.1f}s"
    rows = db.rows()
    assert [(r["status"], r["attempts"], r["lease_until"]) for r in rows] == [("pending", 0, None)] * 6
    assert {r["last_error"] for r in rows} == {"released unpublished at shutdown"}
    assert await wait_until_async(lambda: relay_sessions(pg_dsn, roles.relay) == 0, timeout=5)  # all closed
    assert "already closed" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    # Nothing of the relay is left to claim what comes next.
    db.insert([("order-late", "OrderPlaced", {})])
    await asyncio.sleep(0.5)
    assert db.statuses() == {"pending": 7}


async def test_cancelling_the_task_of_an_async_with_block_stops_the_relay_cleanly(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    before = asyncio.all_tasks()
    entered = asyncio.Event()

    async def app() -> None:
        async with rabbit_relay(relay_dsn, names, rabbit.amqp.url, exchange):
            entered.set()
            await asyncio.Event().wait()  # the application runs until it is cancelled

    task = asyncio.create_task(app())
    await asyncio.wait_for(entered.wait(), 20)
    db.insert((f"order-{i}", "OrderPlaced", {}) for i in range(20))
    assert await wait_until_async(lambda: db.statuses() == {"done": 20}, timeout=20), db.statuses()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await settle()
    assert left_behind(before) == []
    assert len(await rabbit.drain(queue, 20)) == 20


async def test_cancelling_the_start_while_the_broker_never_answers_leaves_nothing_running(
    pg_dsn: str, relay_dsn: str, roles: Roles, names: OutboxNames
) -> None:
    """The task running ``Relay.run()`` cancelled (a timeout around an application's start-up)
    while the relay waits for a broker that accepts the connection and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the client goes

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    before = asyncio.all_tasks()
    relay = rabbit_relay(relay_dsn, names, f"amqp://guest:guest@127.0.0.1:{port}/", "events")
    try:
        starting = asyncio.create_task(relay.run())
        assert await wait_until_async(lambda: bool(held), timeout=20)  # connecting to it now
        await asyncio.sleep(0.3)
        cancelled_at = asyncio.get_running_loop().time()
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        took = asyncio.get_running_loop().time() - cancelled_at
        await settle()
        assert left_behind(before) == []
        assert took < 3, f"the cancel took {took:.1f}s"  # not the 3 x 5 s of connect attempts
        assert await wait_until_async(lambda: relay_sessions(pg_dsn, roles.relay) == 0, timeout=5)
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


# ---- start-up: connected and checked, or the reason


async def test_async_with_a_wrong_amqp_password_raises_the_reason_instead_of_entering(
    pg_dsn: str, relay_dsn: str, roles: Roles, names: OutboxNames, rabbit: Rabbit
) -> None:
    """Before: the block was entered (uvicorn printed "Application startup complete"),
    nothing was logged, and the error came out only when the application stopped."""
    exchange = await rabbit.exchange("topic")
    before = asyncio.all_tasks()
    relay = rabbit_relay(relay_dsn, names, rabbit.amqp.with_password("not-the-password"), exchange)
    with pytest.raises(ConfigError) as raised:
        async with relay:
            pytest.fail("entered a relay that cannot log in to the broker")
    line = str(raised.value)
    assert "login refused for user 'guest' (ACCESS_REFUSED)" in line and "\n" not in line, line
    assert "not-the-password" not in line
    await settle()
    assert left_behind(before) == []
    assert await wait_until_async(lambda: relay_sessions(pg_dsn, roles.relay) == 0, timeout=5)


async def test_start_raises_when_the_database_cannot_be_reached_or_the_outbox_is_not_migrated(
    scratch_dsn: str, names: OutboxNames
) -> None:
    before = asyncio.all_tasks()
    unreachable = Relay(dsn="postgresql://relay@127.0.0.1:1/orders", broker="log")
    with pytest.raises(DatabaseUnavailable, match=r"cannot connect to PostgreSQL at host 127\.0\.0\.1:1"):
        await unreachable.start()
    unmigrated = Relay(dsn=scratch_dsn, broker="log")
    with pytest.raises(ConfigError, match=r"outbox public\.outbox is not set up: run `relay migrate` first"):
        async with unmigrated:
            pytest.fail("entered a relay whose outbox is not migrated")
    await settle()
    assert left_behind(before) == []


async def test_an_error_after_the_start_is_logged_when_it_happens_and_raised_at_the_exit(
    pg_dsn: str, relay_dsn: str, roles: Roles, names: OutboxNames, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    relay = Relay(dsn=relay_dsn, schema=names.schema, broker="log", workers=1, poll_interval="50ms")
    await relay.start()
    # The relay's role loses its rights: the next claim fails, and the relay stops.
    revoke = sql.SQL("REVOKE ALL ON {} FROM {}").format(
        sql.Identifier(names.schema, names.table), sql.Identifier(roles.relay)
    )
    db.conn.execute(revoke)
    assert await wait_until_async(lambda: relay.failed is not None, timeout=10)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and r.name == "relay.embed"]
    assert len(errors) == 1 and "the relay stopped: InsufficientPrivilege" in errors[0].getMessage()
    with pytest.raises(psycopg.errors.InsufficientPrivilege):
        await relay.__aexit__(None, None, None)  # what leaving an ``async with`` block does


# ---- two relays in one process


async def test_two_relays_on_two_outboxes_deliver_side_by_side_and_stop_apart(
    pg_dsn: str,
    relay_dsn: str,
    roles: Roles,
    names: OutboxNames,
    db: Db,
    second_outbox: Db,
    rabbit: Rabbit,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    other = second_outbox
    exchanges = [await rabbit.exchange("topic"), await rabbit.exchange("topic")]
    queues = [await rabbit.queue(bind=(exchanges[0], "#")), await rabbit.queue(bind=(exchanges[1], "#"))]
    before = asyncio.all_tasks()
    first = rabbit_relay(relay_dsn, names, rabbit.amqp.url, exchanges[0])
    second = rabbit_relay(relay_dsn, other.names, rabbit.amqp.url, exchanges[1])

    first_task = asyncio.create_task(first.run())  # one as a task of the application's own
    async with second:  # the other as a context
        db.insert((f"a-{i}", "OrderPlaced", {}) for i in range(30))
        other.insert((f"b-{i}", "OrderPlaced", {}) for i in range(30))
        assert await wait_until_async(lambda: db.statuses() == {"done": 30}, timeout=20), db.statuses()
        assert await wait_until_async(lambda: other.statuses() == {"done": 30}, timeout=20), other.statuses()
        listeners = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(other.names.schema, "outbox_listeners"))

        # The first one goes (cancelled, the harsher way); the second keeps delivering.
        first_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first_task
        db.insert([("a-late", "OrderPlaced", {})])
        other.insert((f"b-late-{i}", "OrderPlaced", {}) for i in range(10))
        assert await wait_until_async(lambda: other.statuses() == {"done": 40}, timeout=20), other.statuses()
        assert db.statuses() == {"done": 30, "pending": 1}
        assert other.conn.execute(listeners).fetchone() == (1,)  # its presence row is its own
        assert second.failed is None
    await settle()
    assert left_behind(before) == []
    assert await wait_until_async(lambda: relay_sessions(pg_dsn, roles.relay) == 0, timeout=5)
    assert [len(await rabbit.drain(q, n)) for q, n in zip(queues, (30, 40), strict=True)] == [30, 40]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "already closed" in r.getMessage()]


# ---- in a web application's lifespan


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(relay: Relay, *, until: Any = None) -> tuple[bool, int]:
    """A FastAPI application with ``relay`` in its lifespan, served by uvicorn in this loop;
    ``until`` runs once it serves (then the server stops). Whether it started, and the
    status of a request made meanwhile."""
    import httpx
    import uvicorn
    from fastapi import FastAPI

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with relay:
            yield

    app = FastAPI(lifespan=lifespan)

    @app.get("/")
    async def index() -> dict[str, str]:
        return {"relay": "failed" if relay.failed else "running"}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_config=None))

    async def use() -> int:
        while not server.started:
            await asyncio.sleep(0.05)
        try:
            async with httpx.AsyncClient() as client:
                status = (await client.get(f"http://127.0.0.1:{port}/")).status_code
            if until is not None:
                await until()
            return status
        finally:
            server.should_exit = True

    user = asyncio.create_task(use())
    try:
        # Awaited here, not as a task: uvicorn raises SystemExit when the start-up fails,
        # which a task would hand to the event loop itself.
        await server.serve()
    except SystemExit:
        pass
    finally:
        if not server.started:
            user.cancel()
    try:
        status = await user
    except asyncio.CancelledError:  # it never served
        status = 0
    return server.started, status


async def test_a_uvicorn_application_does_not_start_when_its_relay_cannot_log_in(
    relay_dsn: str, names: OutboxNames, rabbit: Rabbit, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's reproduction: uvicorn said "Application startup complete" and answered
    200 with a relay that could not log in to RabbitMQ."""
    caplog.set_level(logging.INFO)
    exchange = await rabbit.exchange("topic")
    relay = rabbit_relay(relay_dsn, names, rabbit.amqp.with_password("not-the-password"), exchange)
    started, status = await _serve(relay)
    assert (started, status) == (False, 0)
    assert "Application startup complete" not in caplog.text
    assert "Application startup failed" in caplog.text
    assert "login refused for user 'guest' (ACCESS_REFUSED)" in caplog.text
    assert "not-the-password" not in caplog.text


async def test_a_uvicorn_application_delivers_while_it_serves_and_stops_its_relay_with_it(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    relay = rabbit_relay(relay_dsn, names, rabbit.amqp.url, exchange)
    before = asyncio.all_tasks()

    async def deliver() -> None:
        db.insert((f"order-{i}", "OrderPlaced", {}) for i in range(10))
        assert await wait_until_async(lambda: db.statuses() == {"done": 10}, timeout=20), db.statuses()

    assert await _serve(relay, until=deliver) == (True, 200)
    await settle()
    assert left_behind(before) == []
    assert len(await rabbit.drain(queue, 10)) == 10
    assert "relay started" in caplog.text and "Application startup complete" in caplog.text
