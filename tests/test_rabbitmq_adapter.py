"""The RabbitMQ adapter against a real broker: one test per failure-class row of the
adapter's contract, each fault produced for real (topology changed, the connection closed
or the channels stalled from the broker side, the network cut, limits lowered), never a
mock of aio-pika."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from relay.adapters.rabbitmq import SPEC
from relay.adapters.rabbitmq.publisher import RabbitPublisher
from relay.adapters.rabbitmq.settings import RabbitSettings, RoutingKeyTemplate
from relay.adapters.rabbitmq.unroutable import MAX_KEYS, UnroutableKeys
from relay.contract import DestinationCheck, DestinationState, Outcome
from relay.errors import BrokerUnavailable, ConfigError, DestinationUnavailable, PermanentError, RetryableError
from relay.message import OutboxMessage
from tests.helpers import DEFAULT_LIMITS
from tests.rabbitmq_broker import AmqpService, BrokerControl, Rabbit, TcpProxy, outbox_message, unique

MiB = 1024 * 1024


def kinds(outcomes: Sequence[Outcome]) -> list[str]:
    return [type(o).__name__ if o is not None else "ok" for o in outcomes]


async def publish_until_confirmed(publisher: RabbitPublisher, timeout: float) -> tuple[float, list[Outcome]]:
    """Publish one fresh message again and again until it is confirmed; returns the time it
    took and every failed outcome on the way."""
    return await publish_until_confirmed_as(publisher, outbox_message, timeout)


async def publish_until_confirmed_as(
    publisher: RabbitPublisher, make: Callable[[], OutboxMessage], timeout: float
) -> tuple[float, list[Outcome]]:
    """:func:`publish_until_confirmed` with messages from ``make``."""
    failures: list[Outcome] = []
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        [outcome] = await publisher.publish([make()])
        if outcome is None:
            return time.monotonic() - start, failures
        failures.append(outcome)
        await asyncio.sleep(0.2)
    raise AssertionError(f"not delivered within {timeout}s: {failures[-3:]}")


# -- confirmed -------------------------------------------------------------------------


async def test_confirmed_message_arrives_persistent_with_ids_type_and_headers(rabbit: Rabbit) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue)  # the default exchange routes by queue name
    m = outbox_message(aggregate_id="order-7", event_type="OrderPlaced", body=b'{"total": 12.5}', attempt=3)
    assert await publisher.publish([m]) == [None]

    [got] = await rabbit.drain(queue, 1)
    assert json.loads(got.body) == {"total": 12.5}
    assert got.delivery_mode == 2  # persistent
    assert got.message_id == str(m.id)
    assert got.type == "OrderPlaced"
    assert got.content_type == "application/json"
    assert got.timestamp is not None
    assert abs((datetime.now(UTC) - got.timestamp).total_seconds()) < 60
    assert got.headers == {
        "aggregate_type": "order",
        "aggregate_id": "order-7",
        "event_type": "OrderPlaced",
        "outbox_id": m.id,
        "attempt": 3,
        "lease_version": m.lease_version,
    }


async def test_ordered_messages_carry_their_aggregate_seq_as_an_integer_header(rabbit: Rabbit) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue)
    ordered = outbox_message(ordered=True, aggregate_seq=41)
    unordered = outbox_message(ordered=False)
    assert await publisher.publish([ordered, unordered]) == [None, None]
    got = {int(m.headers["outbox_id"]): m.headers for m in await rabbit.drain(queue, 2)}
    assert got[ordered.id]["aggregate_seq"] == 41 and isinstance(got[ordered.id]["aggregate_seq"], int)
    assert "aggregate_seq" not in got[unordered.id]


async def test_a_batch_is_confirmed_in_one_round_trip_not_one_per_message(rabbit: Rabbit) -> None:
    # 50 ms each way between relay and broker: one confirm per round trip would take 200
    # round trips (over 10 s) for this batch; awaited together it takes a few.
    queue = await rabbit.queue()
    slow = TcpProxy(rabbit.amqp.host, rabbit.amqp.port, latency=0.05)
    await slow.start()
    try:
        publisher = await rabbit.publisher(url=slow.url(rabbit.amqp.url), routing_key=queue)
        assert await publisher.publish([outbox_message()]) == [None]  # opens the channel
        batch = [outbox_message(aggregate_id=f"agg-{i}") for i in range(200)]
        started = time.monotonic()
        outcomes = await publisher.publish(batch)
        elapsed = time.monotonic() - started
    finally:
        await slow.cut()
    assert outcomes == [None] * 200
    assert elapsed < 2.0, f"a batch of 200 took {elapsed:.2f}s over a 50 ms link"
    assert await rabbit.count(queue) == 201


async def test_declare_creates_the_exchange_and_the_routing_key_template_routes(rabbit: Rabbit) -> None:
    name = unique("ex")
    rabbit.exchanges.append(name)  # for cleanup
    publisher = await rabbit.publisher(
        exchange=name,
        declare=True,
        exchange_type="topic",
        routing_key="{aggregate_type}.{event_type}.{aggregate_id}",
    )
    queue = await rabbit.queue(bind=(name, "order.*.#"))
    order = outbox_message(aggregate_type="order", event_type="OrderPlaced", aggregate_id="o-1")
    invoice = outbox_message(aggregate_type="invoice", event_type="InvoiceSent", aggregate_id="i-1")
    outcomes = await publisher.publish([order, invoice])
    assert outcomes[0] is None
    assert isinstance(outcomes[1], DestinationUnavailable)  # no binding for invoice.*: held
    [got] = await rabbit.drain(queue, 1)
    assert got.routing_key == "order.OrderPlaced.o-1"

    # Declaring over an existing exchange of another type is refused at start.
    clash = RabbitPublisher(
        RabbitSettings(url=rabbit.amqp.url, exchange=name, declare=True, exchange_type="fanout"),
        connection_name=unique("clash"),
    )
    with pytest.raises(ConfigError, match=f"cannot declare exchange '{name}' \\(type fanout\\)"):
        await clash.start()


# -- unroutable ------------------------------------------------------------------------


async def test_unroutable_waits_per_routing_key_without_pausing_the_others_and_flows_once_bound(
    rabbit: Rabbit, caplog: pytest.LogCaptureFixture
) -> None:
    exchange = await rabbit.exchange("topic")
    caplog.set_level(logging.INFO, logger="relay.adapters.rabbitmq")
    publisher = await rabbit.publisher(exchange=exchange, routing_key="{aggregate_type}.{event_type}")
    placed = await rabbit.queue(bind=(exchange, "order.OrderPlaced"))

    def order(event_type: str) -> OutboxMessage:
        return outbox_message(aggregate_type="order", event_type=event_type)

    # One key has a queue, one has none: the unroutable one waits (never PermanentError,
    # never RetryableError: no attempt is spent on it), the other is delivered.
    outcomes = await publisher.publish([order("OrderPlaced"), order("OrderShipped")])
    assert kinds(outcomes) == ["ok", "DestinationUnavailable"]
    held = outcomes[1]
    assert isinstance(held, DestinationUnavailable)
    assert "312 NO_ROUTE" in str(held) and "'order.OrderShipped'" in held.destination
    assert timedelta(0) < held.retry_after <= timedelta(seconds=5)
    assert publisher.unroutable() == (held.destination,)

    # While held, its messages are answered at once without being sent (one probe per key
    # at a time, when due); the other key keeps flowing meanwhile.
    waiting = [order("OrderShipped") for _ in range(3)]
    outcomes = await publisher.publish([*waiting, order("OrderPlaced")])
    assert kinds(outcomes)[:3] == ["DestinationUnavailable"] * 3 and outcomes[3] is None
    assert await rabbit.count(placed) == 2

    # One error line for the key however often it comes back.
    for _ in range(3):
        await publisher.publish([order("OrderShipped")])
        await asyncio.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "'order.OrderShipped' reaches no queue (312 NO_ROUTE)" in lines[0], lines

    # Bound: its next probe is routed and the key flows again (within the 5 s probe cap).
    shipped = await rabbit.queue(bind=(exchange, "order.OrderShipped"))
    _, failures = await publish_until_confirmed_as(publisher, lambda: order("OrderShipped"), timeout=8)
    assert all(isinstance(f, DestinationUnavailable) for f in failures), failures
    assert publisher.unroutable() == ()
    assert any("reaches a queue again" in r.getMessage() for r in caplog.records)
    assert await rabbit.count(shipped) == 1


def test_held_keys_are_probed_one_at_a_time_backing_off_and_bounded(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    keys = UnroutableKeys(
        logging.getLogger("relay.adapters.rabbitmq"), "exchange 'x' at amqp://u@h/", clock=lambda: now[0]
    )
    caplog.set_level(logging.INFO, logger="relay.adapters.rabbitmq")
    first = keys.returned("a", "unroutable")
    assert keys.is_held("a") and first.retry_after == timedelta(seconds=0.5)
    assert not keys.take_probe("a")  # not yet due
    now[0] = 0.5
    assert keys.take_probe("a") and not keys.take_probe("a")  # one probe at a time
    keys.no_verdict("a")  # the probe was cut short: the next may go
    assert keys.take_probe("a")
    for expected in (1, 2, 4, 5, 5):  # each return backs the next probe off, up to 5 s
        assert keys.returned("a", "unroutable").retry_after == timedelta(seconds=expected)
    assert keys.waiting("a").retry_after == timedelta(seconds=5)
    keys.delivered("a")
    assert not keys.is_held("a") and keys.held() == ()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "reaches no queue" in lines[0] and "reaches a queue again" in lines[1], lines

    # A template over {aggregate_id}: past MAX_KEYS keys, the rest are held unremembered, one line in all.
    caplog.clear()
    for i in range(MAX_KEYS + 50):
        keys.returned(f"k{i}", "unroutable")
    assert len(keys.held()) == MAX_KEYS and not keys.is_held(f"k{MAX_KEYS}")
    assert (
        len(caplog.records) == MAX_KEYS + 1 and f"more than {MAX_KEYS} routing keys" in caplog.records[-1].getMessage()
    )
    long_key = keys.name("z" * 255)
    assert len(long_key) < 150 and "(255 characters)" in long_key


async def test_a_probe_cut_short_by_the_publish_timeout_does_not_hold_its_key_forever(
    rabbit: Rabbit, proxy: TcpProxy
) -> None:
    exchange = await rabbit.exchange("direct")
    publisher = await rabbit.publisher(url=proxy.url(rabbit.amqp.url), exchange=exchange, routing_key="{event_type}")
    [held] = await publisher.publish([outbox_message(event_type="Late")])
    assert isinstance(held, DestinationUnavailable)
    await asyncio.sleep(held.retry_after.total_seconds())
    proxy.latency = 1.0  # the probe's confirm will come late: the relay's deadline cancels it
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(publisher.publish([outbox_message(event_type="Late")]), 0.3)
    proxy.latency = 0.0
    queue = await rabbit.queue(bind=(exchange, "Late"))
    # (The cut-short publish may cost the connection, and a moment of reconnecting.)
    _, failures = await publish_until_confirmed_as(publisher, lambda: outbox_message(event_type="Late"), timeout=10)
    assert all(isinstance(f, BrokerUnavailable) for f in failures), failures
    assert await rabbit.count(queue) >= 1


async def test_unroutable_is_dead_or_retried_when_configured(rabbit: Rabbit) -> None:
    exchange = await rabbit.exchange("direct")
    strict = await rabbit.publisher(exchange=exchange, routing_key="{event_type}", unroutable="permanent")
    lenient = await rabbit.publisher(exchange=exchange, routing_key="{event_type}", unroutable="retryable")

    [outcome] = await strict.publish([outbox_message(event_type="OrderPlaced")])
    assert isinstance(outcome, PermanentError)
    assert "312 NO_ROUTE" in str(outcome) and exchange in str(outcome) and "'OrderPlaced'" in str(outcome)
    [outcome] = await lenient.publish([outbox_message(event_type="OrderPlaced")])
    assert isinstance(outcome, RetryableError) and "NO_ROUTE" in str(outcome)
    assert strict.unroutable() == lenient.unroutable() == ()

    # Bound: delivered. A return fails only its own message; the channel stays usable.
    queue = await rabbit.queue(bind=(exchange, "OrderPlaced"))
    outcomes = await strict.publish([outbox_message(event_type="OrderPlaced"), outbox_message(event_type="Other")])
    assert kinds(outcomes) == ["ok", "PermanentError"]

    # Unbound again: unroutable again.
    await rabbit.unbind(queue, exchange, "OrderPlaced")
    [outcome] = await strict.publish([outbox_message(event_type="OrderPlaced")])
    assert isinstance(outcome, PermanentError)
    assert await rabbit.count(queue) == 1


async def test_check_destinations_looks_at_the_exchange_or_the_queue_a_constant_key_names(rabbit: Rabbit) -> None:
    exchange = await rabbit.exchange("topic")
    missing = unique("ex")  # never declared
    queue = await rabbit.queue()

    def state(checks: Sequence[DestinationCheck]) -> tuple[DestinationState, str, str]:
        [check] = checks
        assert "guest:" not in check.describe()  # never the password
        return check.state, check.destination, check.reason

    there = await rabbit.publisher(exchange=exchange)
    assert state(await there.check_destinations())[:2] == (
        DestinationState.EXISTS,
        f"exchange '{exchange}' in vhost '/' at amqp://guest@{rabbit.amqp.host}:{rabbit.amqp.port}/",
    )
    absent = await rabbit.publisher(exchange=missing)
    got, name, reason = state(await absent.check_destinations())
    assert got is DestinationState.MISSING and missing in name and f"no exchange '{missing}'" in reason
    # Looking changed nothing: the exchange is still missing, and the publisher still works.
    assert state(await absent.check_destinations())[0] is DestinationState.MISSING
    await rabbit.exchange("topic", name=missing)
    assert state(await absent.check_destinations())[0] is DestinationState.EXISTS

    # The default exchange with a constant routing key: the queue of that name.
    to_queue = await rabbit.publisher(routing_key=queue)
    assert state(await to_queue.check_destinations())[:2] == (
        DestinationState.EXISTS,
        f"queue {queue!r} (where the default exchange routes routing key {queue!r}) at {to_queue.settings.where}",
    )
    nowhere = await rabbit.publisher(routing_key=unique("q"))
    assert state(await nowhere.check_destinations())[0] is DestinationState.MISSING
    # With a template only a publish tells: said, not guessed.
    templated = await rabbit.publisher(routing_key="{event_type}")
    got, name, reason = state(await templated.check_destinations())
    assert got is DestinationState.EXISTS and name.startswith("the default exchange")
    assert "only a publish tells" in reason

    # The connection down: unreachable, at once.
    await absent.close()
    got, _, reason = state(await absent.check_destinations())
    assert got is DestinationState.UNREACHABLE and "down" in reason


@pytest.mark.extended  # rabbitmqctl makes and removes a user: seconds
async def test_check_destinations_needs_no_permission_so_exists_does_not_promise_publishing(
    rabbit: Rabbit, ctl: BrokerControl
) -> None:
    exchange = await rabbit.exchange("topic")
    await rabbit.queue(bind=(exchange, "OrderPlaced"))
    with ctl.user(configure="^$", write="^$", read="^$") as (user, password):
        readonly = await rabbit.publisher(url=rabbit.amqp.with_user(user, password), exchange=exchange)
        try:
            [check] = await readonly.check_destinations()
            outcomes = await readonly.publish([outbox_message()])
        finally:
            await readonly.close()
    assert check.state is DestinationState.EXISTS, check  # a passive declare is allowed to anyone
    assert kinds(outcomes) == ["BrokerUnavailable"] and "ACCESS_REFUSED" in str(outcomes[0])


# -- nack ------------------------------------------------------------------------------


async def test_nack_from_a_full_reject_publish_queue_is_retryable(rabbit: Rabbit) -> None:
    queue = await rabbit.queue(arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    publisher = await rabbit.publisher(routing_key=queue)
    outcomes = await publisher.publish([outbox_message() for _ in range(5)])
    assert sorted(kinds(outcomes)) == ["RetryableError"] * 3 + ["ok"] * 2
    assert all("nacked" in str(o) for o in outcomes if o is not None)
    assert await rabbit.count(queue) == 2


# -- publish timeout ---------------------------------------------------------------------


async def test_no_confirm_within_the_timeout_is_retryable_and_the_broker_may_still_have_it(
    rabbit: Rabbit, ctl: BrokerControl
) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue, confirm_timeout=timedelta(milliseconds=500))
    assert await publisher.publish([outbox_message()]) == [None]  # opens the channel
    pids = await asyncio.to_thread(ctl.suspend_channels, publisher.connection_name)
    assert pids, "found no channel of the publisher's connection"
    try:
        started = time.monotonic()
        outcomes = await publisher.publish([outbox_message() for _ in range(3)])
        elapsed = time.monotonic() - started
    finally:
        await asyncio.to_thread(ctl.resume, pids)
    assert kinds(outcomes) == ["RetryableError"] * 3
    assert all("no confirm from RabbitMQ within 0.5s" in str(o) for o in outcomes)
    assert elapsed < 2
    # Once the stalled channel runs again the broker routes what it had: delivered twice
    # after the retry, which is why consumers de-duplicate by message_id.
    assert len(await rabbit.drain(queue, 4)) == 4
    assert await publisher.publish([outbox_message()]) == [None]  # on a fresh channel


# -- connection lost mid-publish, broker down ---------------------------------------------


async def test_connection_closed_by_the_broker_mid_publish_is_retryable(rabbit: Rabbit, ctl: BrokerControl) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue)
    assert await publisher.publish([outbox_message()]) == [None]
    # Stall the broker's side of the channel so the close lands while confirms are owed.
    pids = await asyncio.to_thread(ctl.suspend_channels, publisher.connection_name)
    assert pids

    async def close_mid_publish() -> int:
        await asyncio.sleep(0.3)  # the batch is written; its confirms cannot come
        return await asyncio.to_thread(ctl.close_connections, publisher.connection_name)

    try:
        outcomes, closed = await asyncio.wait_for(
            asyncio.gather(publisher.publish([outbox_message() for _ in range(20)]), close_mid_publish()), 20
        )
    finally:
        await asyncio.to_thread(ctl.resume, pids)
    assert closed == 1
    # A failure of what the batch shared: the worker publishes its messages apart before any
    # spends an attempt (relay.isolation).
    assert kinds(outcomes) == ["SharedFailure"] * 20
    assert all("connection to RabbitMQ" in str(o) and "lost" in str(o) for o in outcomes)

    # The robust connection comes back by itself; nothing on the way was permanent.
    _, failures = await publish_until_confirmed(publisher, timeout=15)
    assert all(isinstance(f, BrokerUnavailable | RetryableError) for f in failures), failures


async def test_broker_unreachable_refuses_every_message_without_waiting_and_delivery_resumes(
    rabbit: Rabbit, proxy: TcpProxy, caplog: pytest.LogCaptureFixture
) -> None:
    queue = await rabbit.queue()
    caplog.set_level(logging.INFO, logger="relay.adapters.rabbitmq")
    publisher = await rabbit.publisher(url=proxy.url(rabbit.amqp.url), routing_key=queue)
    assert await publisher.publish([outbox_message()]) == [None]

    await proxy.cut()  # the broker is gone, as far as the relay can tell
    await asyncio.sleep(0.3)
    for _ in range(3):
        started = time.monotonic()
        outcomes = await publisher.publish([outbox_message() for _ in range(3)])
        assert time.monotonic() - started < 1.0
        assert kinds(outcomes) == ["BrokerUnavailable"] * 3
        assert "is unreachable" in str(outcomes[0]) and "127.0.0.1" in str(outcomes[0])

    await proxy.restore()
    took, failures = await publish_until_confirmed(publisher, timeout=15)
    assert took < 5, f"delivery resumed only after {took:.1f}s"
    assert all(isinstance(f, BrokerUnavailable) for f in failures), failures

    refused = [r for r in caplog.records if r.name == "relay.adapters.rabbitmq" and r.levelno == logging.ERROR]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert "unreachable" in refused[0].getMessage()
    assert any("delivery resumed" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert "guest:guest" not in caplog.text


# -- size limit --------------------------------------------------------------------------


async def test_message_over_the_broker_size_limit_is_permanent_and_its_neighbours_retryable(
    rabbit: Rabbit, ctl: BrokerControl
) -> None:
    queue = await rabbit.queue()
    small = [outbox_message(body=b'{"small": %d}' % i) for i in range(6)]
    big = outbox_message(body=b'{"big": "' + b"x" * (2 * MiB) + b'"}')
    batch = [*small[:3], big, *small[3:]]
    # The broker reads max_message_size when a channel opens: the publisher's channel opens
    # inside this block, and the limit is restored however the block ends.
    with ctl.max_message_size(1 * MiB):
        publisher = await rabbit.publisher(routing_key=queue)  # its own limit stays at 128 MiB
        outcomes = await publisher.publish(batch)
    assert isinstance(outcomes[3], PermanentError)
    assert "max_message_size of 1048576 bytes" in str(outcomes[3])
    others = [o for i, o in enumerate(outcomes) if i != 3]
    assert all(o is None or isinstance(o, RetryableError) for o in others), kinds(outcomes)
    assert all(isinstance(o, RetryableError) for o in outcomes[4:]), "sent after the big one: never routed"

    # Retried, the neighbours go through on a fresh channel; the big one, claimed again, is
    # now refused before it is sent (the broker's limit was learned from its refusal).
    retry = [m for m, o in zip(batch, outcomes, strict=True) if isinstance(o, RetryableError)]
    again = await publisher.publish([*retry, big])
    assert again[:-1] == [None] * len(retry)
    assert isinstance(again[-1], PermanentError) and "not sent" in str(again[-1])
    arrived = {int(m.headers["outbox_id"]) for m in await rabbit.drain(queue, 6)}
    assert arrived == {m.id for m in small}


async def test_message_over_the_configured_size_is_permanent_without_being_sent(rabbit: Rabbit) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue, max_message_size=1000)
    batch = [outbox_message(), outbox_message(body=b'"' + b"x" * 2000 + b'"'), outbox_message()]
    outcomes = await publisher.publish(batch)
    assert kinds(outcomes) == ["ok", "PermanentError", "ok"]
    assert "exceeds the broker's max message size of 1000 bytes" in str(outcomes[1])
    assert await rabbit.count(queue) == 2


async def test_headers_and_properties_the_client_cannot_encode_are_permanent_before_sending(rabbit: Rabbit) -> None:
    queue = await rabbit.queue()
    publisher = await rabbit.publisher(routing_key=queue)
    long_type = outbox_message(event_type="E" * 300)  # AMQP's `type` property is a 255-byte shortstr
    huge_header = outbox_message(aggregate_id="a" * 200_000)  # the header frame would exceed frame_max
    outcomes = await publisher.publish([long_type, outbox_message(), huge_header, outbox_message()])
    assert kinds(outcomes) == ["PermanentError", "ok", "PermanentError", "ok"]
    assert "cannot be encoded" in str(outcomes[0]) and "255" in str(outcomes[0])
    assert "frame_max" in str(outcomes[2])

    by_aggregate = await rabbit.publisher(routing_key="{aggregate_id}")
    [outcome] = await by_aggregate.publish([outbox_message(aggregate_id="k" * 300)])
    assert isinstance(outcome, PermanentError) and "routing key of 300 bytes" in str(outcome)
    assert await rabbit.count(queue) == 2  # the connection survived and delivered the rest


# -- exchange missing, access refused ----------------------------------------------------


async def test_missing_exchange_refuses_every_message_logs_once_and_delivery_starts_when_it_appears(
    rabbit: Rabbit, caplog: pytest.LogCaptureFixture
) -> None:
    name = unique("ex")  # not declared yet
    caplog.set_level(logging.INFO, logger="relay.adapters.rabbitmq")
    publisher = await rabbit.publisher(exchange=name, routing_key="{event_type}")  # start does not fail
    for _ in range(3):
        outcomes = await publisher.publish([outbox_message(), outbox_message()])
        assert kinds(outcomes) == ["BrokerUnavailable"] * 2
        assert f"exchange '{name}' not found in vhost '/'" in str(outcomes[0])
    errors = [
        r.getMessage() for r in caplog.records if r.name == "relay.adapters.rabbitmq" and r.levelno >= logging.ERROR
    ]
    assert len(errors) == 1, errors
    assert f"'{name}'" in errors[0] and "NOT_FOUND" in errors[0]

    await rabbit.exchange("direct", name=name)
    queue = await rabbit.queue(bind=(name, "OrderPlaced"))
    assert await publisher.publish([outbox_message()]) == [None]  # the next batch uses it
    assert any("delivery resumed" in r.getMessage() for r in caplog.records)

    # Deleted while the relay runs: every message refused again, one more error line.
    await rabbit.delete_exchange(name)
    assert kinds(await publisher.publish([outbox_message()])) == ["BrokerUnavailable"]
    errors = [
        r.getMessage() for r in caplog.records if r.name == "relay.adapters.rabbitmq" and r.levelno >= logging.ERROR
    ]
    assert len(errors) == 2
    assert await rabbit.count(queue) == 1


async def test_access_refused_on_the_exchange_refuses_every_message(rabbit: Rabbit, ctl: BrokerControl) -> None:
    exchange = await rabbit.exchange("direct")
    await rabbit.queue(bind=(exchange, "OrderPlaced"))
    with ctl.user(configure=".*", write="^$", read=".*") as (user, password):
        publisher = await rabbit.publisher(url=rabbit.amqp.with_user(user, password), exchange=exchange)
        try:
            outcomes = await publisher.publish([outbox_message(), outbox_message()])
        finally:
            await publisher.close()
    assert kinds(outcomes) == ["BrokerUnavailable"] * 2
    text = str(outcomes[0])
    assert f"user '{user}' may not publish to exchange '{exchange}'" in text and "ACCESS_REFUSED" in text


# -- ordering ----------------------------------------------------------------------------


async def test_an_ordered_message_waits_for_the_confirm_of_the_one_before_it(rabbit: Rabbit) -> None:
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "OrderPlaced"))
    publisher = await rabbit.publisher(exchange=exchange, routing_key="{event_type}", unroutable="permanent")
    # Two ordered messages of aggregate A in one batch (the ordered claim never does this,
    # the adapter still guards it): the first cannot be routed, so the second must not go.
    first = outbox_message(aggregate_id="A", event_type="Unbound", ordered=True)
    second = outbox_message(aggregate_id="A", event_type="OrderPlaced", ordered=True)
    other_aggregate = outbox_message(aggregate_id="B", event_type="OrderPlaced", ordered=True)
    unordered = outbox_message(aggregate_id="A", event_type="OrderPlaced", ordered=False)
    outcomes = await publisher.publish([first, second, other_aggregate, unordered])
    assert kinds(outcomes) == ["PermanentError", "RetryableError", "ok", "ok"]
    assert "not sent: an earlier ordered message of aggregate 'A'" in str(outcomes[1])
    arrived = {int(m.headers["outbox_id"]) for m in await rabbit.drain(queue, 2)}
    assert arrived == {other_aggregate.id, unordered.id}

    chain = [outbox_message(aggregate_id="C", event_type="OrderPlaced", ordered=True) for _ in range(5)]
    assert await publisher.publish(chain) == [None] * 5
    assert [int(m.headers["outbox_id"]) for m in await rabbit.drain(queue, 5)] == [m.id for m in chain]


# -- start -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("fault", ["wrong password", "unknown vhost", "unreachable"])
async def test_start_fails_after_a_short_retry_with_one_clear_line_and_no_password(
    amqp: AmqpService, fault: str
) -> None:
    secret = "n0t-the-Passw0rd"
    url, expected = {
        "wrong password": (amqp.with_password(secret), "login refused for user 'guest' (ACCESS_REFUSED)"),
        "unknown vhost": (
            amqp.with_path("relay-test-no-such-vhost"),
            "the broker refused to open virtual host 'relay-test-no-such-vhost'",
        ),
        "unreachable": (f"amqp://guest:{secret}@127.0.0.1:{free_port()}/", "unreachable"),
    }[fault]
    publisher = RabbitPublisher(RabbitSettings(url=url), connection_name=unique("start"))
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        await publisher.start()
    elapsed = time.monotonic() - started
    text = str(raised.value)
    assert text.startswith("cannot connect to RabbitMQ at amqp://"), text
    assert expected in text, text
    assert secret not in text and "\n" not in text
    assert 1.5 <= elapsed < 10, f"gave up after {elapsed:.1f}s"


# -- options -----------------------------------------------------------------------------


def test_options_are_named_for_the_cli_and_the_url_is_secret() -> None:
    by_dest = {o.dest: o for o in SPEC.options}
    assert by_dest["amqp_url"].flag == "--amqp-url" and by_dest["amqp_url"].env == "RELAY_AMQP_URL"
    assert by_dest["amqp_url"].secret
    assert {o.section for o in SPEC.options} == {"rabbitmq"}
    assert by_dest["exchange"].default == "" and by_dest["routing_key"].default == "{event_type}"
    assert by_dest["declare"].kind == "bool" and by_dest["declare"].default is False
    assert by_dest["unroutable"].choices == ("wait", "permanent", "retryable")
    assert by_dest["unroutable"].default == "wait"  # a missing binding is a configuration fault: held


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "no RabbitMQ URL: pass --amqp-url, set RELAY_AMQP_URL"),
        ({"amqp_url": "http://guest:pw-secret@host/"}, "invalid --amqp-url"),
        ({"routing_key": "{aggregate}"}, "unknown field {aggregate} (use {aggregate_type}"),
        ({"routing_key": "{event_type!r}"}, "unknown field {event_type!r}"),
        ({"routing_key": "{event_type:>5}"}, "unknown field {event_type:>5}"),
        ({"routing_key": "orders.{event_type"}, "invalid --routing-key 'orders.{event_type'"),
        ({"declare": True}, "--declare needs --exchange"),
    ],
)
def test_bad_options_are_one_line_config_errors(values: dict[str, object], message: str) -> None:
    values = {"amqp_url": "amqp://guest:pw-secret@127.0.0.1:5672/", **values} if values else values
    with pytest.raises(ConfigError) as raised:
        SPEC.create(values, DEFAULT_LIMITS)
    assert message in str(raised.value)
    assert "pw-secret" not in str(raised.value)


def test_routing_key_template_and_default_confirm_timeout() -> None:
    settings = RabbitSettings.from_values(
        {
            "amqp_url": "amqp://u:p@h/",
            "routing_key": "{aggregate_type}.{event_type}.{aggregate_id}.x",
        },
        replace(DEFAULT_LIMITS, publish_timeout=timedelta(seconds=10)),
    )
    m = outbox_message(aggregate_type="order", event_type="OrderPaid", aggregate_id="o-9")
    assert settings.routing_key.render(m) == "order.OrderPaid.o-9.x"
    assert settings.confirm_timeout == timedelta(seconds=8)  # 80% of --publish-timeout
    assert settings.vhost == "/" and settings.user == "u"
    assert RabbitSettings(url="amqp://u:p@h:5672/%2Fprod").vhost == "/prod"
    # A template with no field is one key for every message (the destination check looks
    # at the queue of that name on the default exchange).
    assert settings.routing_key.constant is None
    assert RoutingKeyTemplate("orders{{eu}}").constant == "orders{eu}" == RoutingKeyTemplate("orders{{eu}}").render(m)
    assert RoutingKeyTemplate("{event_type}").constant is None


def test_reading_the_options_does_not_import_aio_pika() -> None:
    # `relay --help` and the other brokers read every broker's options.
    code = "import sys, relay.adapters.rabbitmq; assert 'aio_pika' not in sys.modules, 'aio_pika imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
