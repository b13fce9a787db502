"""`relay start` as a new user meets it, as a real process against PostgreSQL and RabbitMQ:
/readyz says what the destination check found (a mistyped exchange is 503, not 200),
unroutable messages wait instead of going dead and flow once a queue is bound, in commit
order per aggregate, and SIGTERM stops a start-up that waits for a database or a broker
that never answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.helpers import free_port, http_get
from tests.producers import Arrival, CommitLog, order_violations, producers_both_ways
from tests.rabbitmq_broker import Rabbit, relay_args, unique
from tests.relay_process import RelayProcess, wait_until_async


async def readyz(port: int) -> tuple[int, str]:
    return await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/readyz")


async def wait_for_readyz(port: int, status: int, process: RelayProcess, timeout: float) -> tuple[str, float]:
    """Poll /readyz until it answers ``status``: its body and how long that took."""
    started = time.monotonic()
    last: tuple[int, str] = (0, "")
    while time.monotonic() - started < timeout:
        assert process.running(), process.tail()
        last = await readyz(port)
        if last[0] == status:
            return last[1], time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"/readyz never answered {status} within {timeout}s; last {last}\n{process.tail()}")


def metrics_args(port: int) -> list[str]:
    return ["--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--poll-interval", "100ms"]


@pytest.mark.parametrize("where", ["--exchange", "--route"])
async def test_readyz_is_503_while_a_destination_is_missing_and_200_within_seconds_of_its_creation(
    relay_dsn: str, names: OutboxNames, rabbit: Rabbit, relays: list[RelayProcess], where: str
) -> None:
    """The issue's finding: a mistyped exchange logged an error while /readyz said ready.
    Here the exchange (or a route's, the default one being there) is missing and no
    message is written, so only the start-up check can tell."""
    there = await rabbit.exchange("topic")
    missing = unique("ex")  # "mistyped": created only later
    rabbit.exchanges.append(missing)
    port = free_port()
    destination = (
        ["--exchange", missing] if where == "--exchange" else ["--exchange", there, "--route", f"I*={missing}"]
    )
    process = RelayProcess("start", *relay_args(relay_dsn, names, rabbit.amqp.url, *destination), *metrics_args(port))
    relays.append(process)
    body, _ = await wait_for_readyz(port, 503, process, timeout=20)
    where = f"amqp://guest@{rabbit.amqp.host}:{rabbit.amqp.port}/"
    assert body == (
        f"not ready: destination exchange '{missing}' in vhost '/' at {where} missing:"
        f" NOT_FOUND - no exchange '{missing}' in vhost '/'\n"
    )
    assert (await readyz(port))[0] == 503  # and stays so: it is still missing
    said = [line for line in process.stderr().splitlines() if f"destination exchange '{missing}'" in line]
    assert len(said) == 1 and " ERROR " in said[0] and "/readyz answers 503 until it is there" in said[0], said

    await rabbit.exchange("topic", name=missing)
    body, took = await wait_for_readyz(port, 200, process, timeout=10)
    assert body == "ready\n"
    assert took < 7, f"ready {took:.1f}s after the exchange was created"  # rechecked every 0.5 s to 5 s
    assert f"destination exchange '{missing}' in vhost '/' at {where} is there now" in process.stderr()
    assert process.stop() == 0
    process.assert_clean_exit()
    assert "guest:guest" not in process.stderr() and "Traceback" not in process.stderr()


def family(pg_dsn: str, producer_dsn: str, names: OutboxNames, event_type: str, prefix: str) -> list[CommitLog]:
    """Producers of ``event_type`` that lock their aggregates and producers that do not,
    run to the end: their commit logs, the order oracles."""
    locked, unlocked, producing = producers_both_ways(
        pg_dsn,
        names,
        locked_aggregates=[f"{prefix}-L{i}" for i in range(4)],
        unlocked_aggregates=[f"{prefix}-U{i}" for i in range(3)],
        locked_tx=4,
        unlocked_rounds=4,
        seeds=(25, 26),
        locked_options={"event_type": event_type},
        unlocked_options={"event_type": event_type, "unordered_type": None},
        producer_dsn=producer_dsn,
    )
    producing.join()
    return [locked, unlocked]


async def test_unroutable_messages_wait_unspent_in_order_and_flow_once_a_queue_is_bound(
    pg_dsn: str, producer_dsn: str, relay_dsn: str, db: Db, rabbit: Rabbit, relays: list[RelayProcess]
) -> None:
    """The issue's finding: with --exchange forgotten, the default exchange returned the
    first message (312 NO_ROUTE) and it went dead, blocking its aggregate. Here that key's
    messages wait, attempts refunded, while another key flows; /readyz and the metrics say
    so; the queue is bound while the relay runs and everything arrives, in commit order per
    aggregate, nothing dead."""
    held_type = unique("q")  # the default exchange routes by queue name: no queue yet
    flowing_type = unique("q")
    flowing_queue = await rabbit.queue(name=flowing_type)
    port = free_port()
    process = RelayProcess("start", *relay_args(relay_dsn, db.names, rabbit.amqp.url), *metrics_args(port))
    relays.append(process)
    await wait_for_readyz(port, 200, process, timeout=20)  # nothing tells yet that a key reaches no queue

    logs = await asyncio.to_thread(family, pg_dsn, producer_dsn, db.names, held_type, "held")
    held_ids = set().union(*(log.ids() for log in logs))
    flowing_ids = set(await asyncio.to_thread(db.insert, [(f"flow-{i}", flowing_type, {}) for i in range(20)]))

    def rows() -> dict[int, dict[str, object]]:
        return {r["id"]: r for r in db.rows()}

    # The other key flows; the unroutable one waits, not one message dead.
    assert await wait_until_async(
        lambda: {r["status"] for i, r in rows().items() if i in flowing_ids} == {"done"}, timeout=20
    ), db.statuses()
    body, _ = await wait_for_readyz(port, 503, process, timeout=10)
    assert body.startswith("not ready: unroutable: exchange '' (the default exchange) at amqp://guest@") and (
        f"routing key '{held_type}' reach no queue; their messages wait" in body
    ), body
    metrics = (await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/metrics"))[1]
    assert "outbox_relay_unroutable_routing_keys 1.0" in metrics
    await asyncio.sleep(1)  # more probe rounds
    now = {r["id"]: r for r in await asyncio.to_thread(db.at_rest)}
    assert {now[i]["status"] for i in held_ids} == {"pending"}, db.statuses()
    assert {now[i]["attempts"] for i in held_ids} == {0}, "waiting for a queue must not spend attempts"
    lines = [line for line in process.stderr().splitlines() if "reaches no queue (312 NO_ROUTE)" in line]
    assert len(lines) == 1 and f"routing key '{held_type}'" in lines[0], lines  # once per key

    await rabbit.queue(name=held_type)
    bound = time.monotonic()
    assert await wait_until_async(lambda: db.statuses() == {"done": len(held_ids) + 20}, timeout=20), db.statuses()
    assert time.monotonic() - bound < 10
    await wait_for_readyz(port, 200, process, timeout=10)
    assert process.stop() == 0
    process.assert_clean_exit()

    now = rows()
    assert {now[i]["attempts"] for i in held_ids} == {1}  # the one that delivered it
    received = await rabbit.drain(held_type, len(held_ids), timeout=10)
    assert {int(m.headers["outbox_id"]) for m in received} == held_ids
    arrivals = [Arrival(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"])) for m in received]
    for log in logs:
        assert order_violations(log.expected(), arrivals) == []
    assert len(await rabbit.drain(flowing_queue, 20, timeout=10)) == 20
    assert "reaches a queue again" in process.stderr()


# --- SIGTERM during start-up ---------------------------------------------------------------


def assert_prompt_clean_stop(process: RelayProcess, step: str) -> float:
    """SIGTERM now: exit 0 within a few seconds, the step named, no traceback."""
    started = time.monotonic()
    code = process.stop(timeout=10)
    took = time.monotonic() - started
    assert code == 0, (code, process.tail())
    process.assert_clean_exit()
    log = process.stderr()
    assert f"stopped while {step}; nothing was claimed" in log, log
    assert "Traceback" not in log and "relay: " not in log, log
    assert took < 3, f"SIGTERM took {took:.1f}s:\n{log}"
    return took


async def test_sigterm_while_the_broker_never_answers_stops_start_up_at_once(
    relay_dsn: str, names: OutboxNames, relays: list[RelayProcess]
) -> None:
    """A broker port that accepts and never answers: the connect would wait 5 s per try,
    three tries (about 17 s, then exit 2); SIGTERM cuts it short."""
    with first_connection_only(None) as (port, accepted):
        url = f"amqp://guest:guest@127.0.0.1:{port}/"
        process = RelayProcess("start", *relay_args(relay_dsn, names, url))
        relays.append(process)
        assert await wait_until_async(accepted.is_set, timeout=20), process.tail()  # connecting to it now
        await asyncio.sleep(0.5)
        assert_prompt_clean_stop(process, "connecting to the broker")


@contextlib.contextmanager
def first_connection_only(upstream: tuple[str, int] | None) -> Iterator[tuple[int, threading.Event]]:
    """A TCP port that forwards its first connection to ``upstream`` (None: none) and then
    accepts every other one and never answers: a server gone silent after the relay's first
    look. Yields the port and an event set once a silent connection was accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()
    accepted = threading.Event()
    held: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        forward = upstream
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if forward is None:
                accepted.set()
                continue
            to = socket.create_connection(forward)
            forward = None
            held.append(to)
            for a, b in ((conn, to), (to, conn)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1]), accepted
    finally:
        stop.set()
        thread.join()
        for s in held:
            with contextlib.suppress(OSError):
                s.close()
        listener.close()


async def test_sigterm_while_the_database_stops_answering_stops_start_up_at_once(
    relay_dsn: str, names: OutboxNames, relays: list[RelayProcess]
) -> None:
    """The issue's rough edge: a relay whose sessions were lost during start-up ignored
    SIGTERM for about 30 s (it waited for a pool connection). Here the relay's first look
    at the database goes through, and every connection after it is never answered."""
    given = conninfo_to_dict(relay_dsn)
    target = (str(given.get("host") or "127.0.0.1"), int(given.get("port") or 5432))
    with first_connection_only(target) as (port, accepted):
        dsn = make_conninfo(relay_dsn, host="127.0.0.1", port=str(port))
        process = RelayProcess("start", "--dsn", dsn, "--schema", names.schema, "--broker", "log")
        relays.append(process)
        assert await wait_until_async(accepted.is_set, timeout=20), process.tail()  # the pool's connections
        await asyncio.sleep(1)
        assert process.running(), process.tail()
        assert "relay started" not in process.stderr()
        assert_prompt_clean_stop(process, "checking the outbox")
