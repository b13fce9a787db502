"""RabbitMQ resource alarms, for real: the shared broker's memory watermark (or disk free
limit) is set where no machine is, so it blocks every publishing connection
(``connection.blocked``), and restored to its exact previous value afterwards.

A blocked broker is an outage, not the messages' fault: no attempt spent, nothing dead,
the breaker open with ``blocked: memory`` in the log and in /readyz, and delivery resuming
within seconds of the unblock. The alarm windows are kept short (the broker is shared);
the tests that raise an alarm are in the ``faults`` marker (``make test-faults``), and
``pytest -m faults -k alarm`` runs them alone. The first two need no broker.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import timedelta

import pytest

from relay.adapters.rabbitmq.blocked import Blocking, alarm_kind
from relay.db.names import OutboxNames
from relay.errors import BrokerUnavailable
from tests.conftest import Db
from tests.deliveries import ORDERED, check_deliveries, read_queue, store_fleet_ordering
from tests.producers import fleet_producers, merged
from tests.rabbitmq_broker import AmqpService, BrokerControl, Rabbit, outbox_message
from tests.relay_process import RelayProcess, relay_env

# -- without the broker: the reason texts and the cut-short wait -------------------------


def test_the_alarm_kind_comes_from_rabbitmqs_reason_text() -> None:
    assert alarm_kind("low on memory") == "memory"
    assert alarm_kind("low on disk") == "disk"
    assert alarm_kind("low on memory & low on disk") == "memory & disk"
    assert alarm_kind("") == "no reason given"
    assert alarm_kind("some\x1b[2Jthing new") == "some\\x1b[2Jthing new"


async def test_a_block_expires_the_confirm_waits_in_progress_and_refuses_until_the_unblock() -> None:
    blocking = Blocking(logging.getLogger("tests.alarms"), "127.0.0.1:5672")
    assert blocking.refusal() is None

    async def wait_for_confirms() -> None:
        async with asyncio.timeout(30) as deadline:
            with blocking.cut_short(deadline):
                asyncio.get_running_loop().call_later(0.05, blocking.block, "low on memory")
                await asyncio.sleep(30)

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await wait_for_confirms()
    assert time.monotonic() - started < 1
    refusal = blocking.refusal()
    assert isinstance(refusal, BrokerUnavailable)
    assert str(refusal).startswith("blocked: memory (RabbitMQ at 127.0.0.1:5672 says 'low on memory'")
    blocking.unblock()
    assert blocking.refusal() is None


# -- the adapter under a real alarm -------------------------------------------------------


@pytest.mark.faults
@pytest.mark.extended
@pytest.mark.parametrize("kind", ["memory", "disk"])
async def test_alarm_blocked_publisher_refuses_at_once_and_delivers_after_the_unblock(
    rabbit: Rabbit, ctl: BrokerControl, kind: str
) -> None:
    queue = await rabbit.queue()
    # A confirm timeout far longer than the test takes: the block must cut the wait short.
    publisher = await rabbit.publisher(routing_key=queue, confirm_timeout=timedelta(seconds=20))
    assert await publisher.publish([outbox_message()]) == [None]

    alarm = ctl.memory_alarm() if kind == "memory" else ctl.disk_alarm()
    with alarm:
        # RabbitMQ blocks a connection when it next publishes: this batch is written, then
        # the block arrives while its confirms are awaited.
        started = time.monotonic()
        in_flight = await publisher.publish([outbox_message(), outbox_message(aggregate_id="o-2", ordered=True)])
        cut_after = time.monotonic() - started
        assert all(isinstance(o, BrokerUnavailable) for o in in_flight), in_flight
        assert str(in_flight[0]).startswith(f"blocked: {kind} ("), in_flight[0]
        assert f"says 'low on {kind}'" in str(in_flight[0])
        assert cut_after < 5, cut_after

        # While blocked, nothing is sent: the answer comes without a round trip.
        started = time.monotonic()
        refused = [outbox_message() for _ in range(5)]
        later = await publisher.publish(refused)
        refused_after = time.monotonic() - started
        assert all(isinstance(o, BrokerUnavailable) and str(o).startswith(f"blocked: {kind}") for o in later)
        assert refused_after < 0.05, refused_after
    restored = time.monotonic()

    delivered = None
    while delivered is None and time.monotonic() - restored < 15:
        [outcome] = await publisher.publish([m := outbox_message()])
        if outcome is None:
            delivered = m.id
        else:
            assert isinstance(outcome, BrokerUnavailable), outcome
            await asyncio.sleep(0.1)
    assert delivered is not None, "nothing confirmed within 15 s of the unblock"
    print(
        f"\n  {kind} alarm: in-flight batch answered after {cut_after:.2f}s, the next in"
        f" {refused_after * 1000:.2f} ms; confirmed again {time.monotonic() - restored:.2f}s after the restore"
    )
    got = await rabbit.drain(queue, 2)
    ids = [int(m.headers["outbox_id"]) for m in got]
    assert delivered in ids
    # The in-flight batch reached the broker before the block: the broker may have taken it
    # once it read on (a duplicate of the retry); the batch refused while blocked, never.
    assert not {m.id for m in refused} & set(ids)


@pytest.mark.faults
@pytest.mark.extended
async def test_alarm_blocking_one_batch_cuts_short_another_batch_opening_its_channel(
    rabbit: Rabbit, ctl: BrokerControl
) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue, confirm_timeout=timedelta(seconds=20))
    assert await publisher.publish([outbox_message()]) == [None]  # leaves one idle channel
    with ctl.memory_alarm():
        started = time.monotonic()
        # The first takes the idle channel and publishes (which gets the connection blocked);
        # the second opens a channel, an open the blocked broker does not read.
        first, second = await asyncio.gather(
            publisher.publish([outbox_message()]), publisher.publish([outbox_message()])
        )
        took = time.monotonic() - started
    for outcome in (*first, *second):
        assert isinstance(outcome, BrokerUnavailable) and str(outcome).startswith("blocked: memory"), outcome
    # Not the 5 s channel-open timeout: a relay's publish timeout would cut that short and
    # spend the attempt.
    assert took < 1, took


@pytest.mark.faults
@pytest.mark.extended
async def test_alarm_blocked_publisher_closes_without_waiting_on_each_channel(
    rabbit: Rabbit, ctl: BrokerControl
) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue)
    # Four batches side by side leave four idle channels.
    await asyncio.gather(*(publisher.publish([outbox_message()]) for _ in range(4)))
    with ctl.memory_alarm():
        [blocked] = await publisher.publish([outbox_message()])
        assert isinstance(blocked, BrokerUnavailable), blocked
        started = time.monotonic()
        await publisher.close()
        took = time.monotonic() - started
    # The blocked broker answers no Channel.Close: closing each idle channel, or waiting for
    # the close of the one the block cut short, would wait out 2 s apiece, and a relay stopped
    # during an alarm could overrun its shutdown grace. What is left is the connection's own
    # close, which the broker does not answer either (about 2 s).
    assert took < 3, took
    print(f"\n  a blocked publisher closed in {took:.1f}s")


# -- a relay process under a real memory alarm --------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def wait_until_ready(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await asyncio.to_thread(readyz, port))[0] == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"/readyz not 200 within {timeout}s")


@pytest.mark.faults
async def test_alarm_memory_holds_every_row_pending_without_attempts_and_delivers_in_order_after(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    ctl: BrokerControl,
) -> None:
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    store_fleet_ordering(pg_dsn, names)
    port = free_port()
    args = [
        "--schema", names.schema, "--broker", "rabbitmq", "--exchange", exchange, "--routing-key", "outbox",
        "--workers", "2", "--batch-size", "20", "--lease", "3s", "--publish-timeout", "1s",
        "--poll-interval", "200ms", "--backoff-base", "100ms", "--backoff-cap", "1s", "--max-attempts", "3",
        "--ordering-default", "unordered", "--ordered", ORDERED, "--shutdown-grace", "5s",
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
    ]  # fmt: skip
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_AMQP_URL=amqp.url, RELAY_LOG_LEVEL="info")
    with RelayProcess("start", *args, env=env) as relay:
        await wait_until_ready(port)
        before = db.insert((f"warm-{i % 5}", "EmailQueued", {"i": i}) for i in range(40))
        while db.statuses() != {"done": 40}:
            await asyncio.sleep(0.1)

        with ctl.memory_alarm():
            alarm_at = time.monotonic()
            # With --max-attempts 3, a backoff capped at 1 s and a confirm timeout of 0.8 s,
            # a block read as confirm timeouts would send rows to dead within about 3 s.
            locked, unlocked, producers = fleet_producers(
                pg_dsn, names, seed=15, locked_tx=40, unlocked_rounds=12, producer_dsn=producer_dsn
            )
            await asyncio.to_thread(producers.join, 15)
            assert not producers.is_alive(), "producers still writing 15 s into the alarm"
            await relay.wait_for_log("broker unavailable, pausing claims", timeout=10)
            await asyncio.sleep(max(0.0, 10 - (time.monotonic() - alarm_at)))
            rows = [r for r in db.rows() if r["id"] not in set(before)]
            statuses = Counter(r["status"] for r in rows)
            # A probe of the breaker may have one row claimed at this instant (per worker).
            assert statuses["pending"] >= len(rows) - 2 and not statuses["done"] and not statuses["dead"], statuses
            spent = Counter(r["attempts"] for r in rows if r["status"] == "pending")
            assert set(spent) == {0}, spent
            status, body = await asyncio.to_thread(readyz, port)
            assert status == 503 and body.startswith("not ready: broker: BrokerUnavailable: blocked: memory ("), body
            window = time.monotonic() - alarm_at
        unblocked = time.monotonic()

        expected_ids = {r["id"] for r in db.rows()}
        during = expected_ids - set(before)
        first_done = None
        while time.monotonic() - unblocked < 30:
            statuses = db.statuses()
            if first_done is None and statuses.get("done", 0) > len(before):
                first_done = time.monotonic() - unblocked
            if statuses == {"done": len(expected_ids)}:
                break
            await asyncio.sleep(0.05)
        all_done = time.monotonic() - unblocked
        assert db.statuses() == {"done": len(expected_ids)}, db.statuses()
        assert (await asyncio.to_thread(readyz, port))[0] == 200
        log = relay.stderr()
        pause = next(line for line in log.splitlines() if "broker unavailable, pausing claims" in line)
        assert "blocked: memory" in pause, pause
        assert re.search(r"broker is back after \d+\.\ds; resuming claims", log), log[-3000:]
        assert "unblocked the connection after" in log
        relay.stop()
        relay.assert_clean_exit()

    rows = {r["id"]: r for r in db.rows()}
    attempts = Counter(rows[i]["attempts"] for i in during)
    # The alarm spent nothing: the one claim that delivered is each row's only attempt.
    assert set(attempts) == {1}, attempts
    deliveries = await read_queue(amqp, queue, expected_ids)
    duplicates = check_deliveries(db, deliveries, merged(locked, unlocked))
    print(
        f"\n  memory alarm for {window:.1f}s: {len(during)} rows written meanwhile, all pending with"
        f" 0 attempts; after the restore the first delivered in {first_done:.2f}s, all in {all_done:.2f}s;"
        f" {sum(duplicates.values())} duplicates"
    )


@pytest.mark.faults
@pytest.mark.extended
async def test_alarm_sigterm_during_a_memory_alarm_exits_0_in_time_and_spends_nothing(
    relay_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    ctl: BrokerControl,
) -> None:
    exchange = await rabbit.exchange("direct")
    await rabbit.queue(bind=(exchange, "outbox"))
    args = [
        "--schema", names.schema, "--broker", "rabbitmq", "--exchange", exchange, "--routing-key", "outbox",
        "--workers", "4", "--batch-size", "20", "--publish-timeout", "1s", "--poll-interval", "200ms",
        "--max-attempts", "3", "--shutdown-grace", "5s",
    ]  # fmt: skip
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_AMQP_URL=amqp.url, RELAY_LOG_LEVEL="warning")
    with RelayProcess("start", *args, env=env) as relay:
        # Enough at once for every worker to open a channel of its own.
        db.insert((f"warm-{i}", "EmailQueued", {"i": i}) for i in range(400))
        while db.statuses() != {"done": 400}:
            await asyncio.sleep(0.1)
        with ctl.memory_alarm():
            during = db.insert((f"order-{i % 7}", "OrderPlaced", {"i": i}) for i in range(50))
            await relay.wait_for_log("blocked: memory", timeout=10)
            started = time.monotonic()
            code = relay.stop(timeout=20)
            took = time.monotonic() - started
            rows = [r for r in db.rows() if r["id"] in set(during)]
        assert code == 0, relay.tail()
        relay.assert_clean_exit()
    assert Counter((r["status"], r["attempts"]) for r in rows) == {("pending", 0): len(during)}
    # Nothing is in flight to wait for, so no need of the shutdown grace: what remains is the
    # connection's close (about 2 s, unanswered). Closing each idle channel first took 8 s.
    assert took < 5, took
    print(f"\n  SIGTERM during a memory alarm: exit 0 in {took:.1f}s, {len(during)} rows pending with 0 attempts")
