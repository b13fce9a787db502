"""`relay start --broker rabbitmq` as a real process, between a real PostgreSQL outbox and a
real RabbitMQ: the whole path, its start-up failures, and topology that appears late."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict
from pathlib import Path

import pytest

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.producers import (
    Arrival,
    CommitLog,
    LockedProducers,
    create_producer_tables,
    order_violations,
    produce_unlocked,
)
from tests.rabbitmq_broker import AmqpService, Rabbit, relay_args, unique
from tests.relay_process import RelayProcess, run_relay, wait_until_async


async def wait_until_done(db: Db, process: RelayProcess, total: int, timeout: float) -> float:
    """Seconds until all ``total`` rows are done; fails at once on a dead row or a relay that exited."""
    started = time.monotonic()

    def drained() -> bool:
        statuses = db.statuses()
        assert "dead" not in statuses, statuses
        assert process.running(), process.stderr()
        return statuses == {"done": total}

    assert await wait_until_async(drained, timeout, interval=0.25), f"not drained within {timeout}s: {db.statuses()}"
    return time.monotonic() - started


async def test_relay_start_drains_events_of_locking_unlocked_and_bulk_producers_in_commit_order(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    relays: list[RelayProcess],
    tmp_path: Path,
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "order.#"))
    # A bulk writer: 40 events per aggregate, three ordered types and one unordered type
    # interleaved, one transaction.
    types = ("OrderPlaced", "OrderPaid", "OrderShipped", "EmailSent")
    rows = [(f"order-{i % 50}", types[(i // 50) % 4], {"seq": i}) for i in range(2000)]
    # Services that lock the aggregate before writing (the design reference's pattern),
    # and services that do not, on aggregates of their own.
    locked_aggs, unlocked_aggs = [f"acct-L{i}" for i in range(10)], [f"acct-U{i}" for i in range(6)]
    create_producer_tables(pg_dsn, names, locked_aggs, producer_dsn=producer_dsn)
    locked, unlocked = CommitLog(), CommitLog()
    # Rows are routed to the ordered or unordered claim when inserted, by the stored map:
    # the operator stores it first (relay start only reads it).
    stored = run_relay(
        "settings", "set", "--dsn", relay_dsn, "--schema", names.schema, "--ordered", "Order*", "--unordered", "Email*"
    )
    assert stored.returncode == 0, stored.stderr

    process = RelayProcess(
        "start",
        *relay_args(relay_dsn, names, rabbit.amqp.url),
        "--exchange",
        exchange,
        "--routing-key",
        "{aggregate_type}.{event_type}",
        "--workers",
        "3",
    )
    relays.append(process)
    await process.wait_for_log("relay started")
    bulk = asyncio.to_thread(db.insert, rows)
    locking = asyncio.to_thread(
        LockedProducers(producer_dsn, names, locked_aggs, locked, threads=3, unordered_type="EmailQueued", seed=1).run,
        40,
    )
    unlocking = asyncio.to_thread(produce_unlocked, producer_dsn, names, unlocked_aggs, unlocked, rounds=40, seed=2)
    ids, _, _ = await asyncio.gather(bulk, locking, unlocking)
    total = len(await asyncio.to_thread(db.rows))
    await wait_until_done(db, process, total, timeout=90)
    assert process.stop() == 0, process.stderr()

    messages = await rabbit.drain(queue, total, timeout=30)
    arrived = [int(m.headers["outbox_id"]) for m in messages]
    assert sorted(arrived) == sorted(r["id"] for r in db.rows()), "every outbox id exactly once"
    by_id = {i: row for i, row in zip(ids, rows, strict=True)}
    ordered_per_aggregate: dict[str, list[int]] = defaultdict(list)
    seqs: dict[str, list[int]] = defaultdict(list)
    for m in messages:
        headers = m.headers
        outbox_id = int(m.headers["outbox_id"])
        if str(headers["event_type"]).startswith("Order"):
            seqs[str(headers["aggregate_id"])].append(int(str(headers["aggregate_seq"])))
        else:
            assert "aggregate_seq" not in headers
        if outbox_id not in by_id:
            continue
        aggregate_id, event_type, payload = by_id[outbox_id]
        assert (headers["outbox_id"], headers["aggregate_id"], headers["event_type"]) == (
            outbox_id,
            aggregate_id,
            event_type,
        )
        assert json.loads(m.body) == payload and m.routing_key == f"order.{event_type}"
        if event_type.startswith("Order"):
            ordered_per_aggregate[aggregate_id].append(outbox_id)
    assert len(ordered_per_aggregate) == 50
    for aggregate_id, sequence in ordered_per_aggregate.items():
        assert sequence == sorted(sequence), f"{aggregate_id} arrived out of order"  # one writer: id order
    received = [Arrival(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"])) for m in messages]
    assert order_violations(locked.expected(), received) == []
    assert order_violations(unlocked.expected(), received) == []
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values()), "aggregate_seq is 1, 2, 3, ..."
    assert "Traceback" not in process.stderr()


async def test_a_missing_exchange_never_stops_relay_start_and_delivery_begins_once_it_exists(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path
) -> None:
    name = unique("ex")  # created by "the deployment" only after the relay started
    ids = await asyncio.to_thread(db.insert, [(f"order-{i}", "OrderPlaced", {"i": i}) for i in range(20)])
    process = RelayProcess(
        "start",
        *relay_args(relay_dsn, names, rabbit.amqp.url),
        "--exchange",
        name,
        "--routing-key",
        "{event_type}",
        "--workers",
        "2",
    )
    relays.append(process)

    # Until a publish met the missing exchange (not a fixed sleep: a loaded machine starts
    # the relay more slowly, and the exchange must still be missing when it first tries).
    def met_missing() -> bool:
        lines = process.stderr().splitlines()
        return any("relay.adapters.rabbitmq:" in line and f"exchange '{name}' not found" in line for line in lines)

    tried = await wait_until_async(met_missing, timeout=30)
    assert tried and process.running(), process.stderr()
    statuses = await asyncio.to_thread(db.statuses)
    assert set(statuses) <= {"pending", "processing"}, statuses  # nothing dead, nothing sent

    await rabbit.exchange("direct", name=name)
    queue = await rabbit.queue(bind=(name, "OrderPlaced"))
    took = await wait_until_done(db, process, 20, timeout=30)
    assert took < 8, f"delivery began {took:.1f}s after the exchange appeared"
    assert process.stop() == 0, process.stderr()

    assert sorted(int(m.headers["outbox_id"]) for m in await rabbit.drain(queue, 20)) == ids
    attempts = {row["attempts"] for row in await asyncio.to_thread(db.rows)}
    assert attempts == {1}, "waiting for the exchange must not spend attempts"
    errors = [line for line in process.stderr().splitlines() if " ERROR " in line]
    ours = [line for line in errors if "relay.adapters.rabbitmq:" in line]
    assert len(ours) == 1, errors  # one line for the outage, not one per batch or message
    assert f"exchange '{name}' not found" in ours[0]
    # The start-up check said it once before any publish; the core's circuit breaker
    # reports the same outage once more, in its own words.
    checked = [line for line in errors if "relay.readiness:" in line]
    assert len(checked) == 1 and f"destination exchange '{name}' in vhost '/'" in checked[0], errors
    assert "missing: NOT_FOUND" in checked[0]
    assert all(
        "relay.adapters.rabbitmq:" in line or "relay.breaker:" in line or "relay.readiness:" in line for line in errors
    ), errors
    where = f"amqp://guest@{rabbit.amqp.host}:{rabbit.amqp.port}/"
    assert f"destination exchange '{name}' in vhost '/' at {where} is there now" in process.stderr()
    assert "delivery resumed" in process.stderr()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.parametrize("fault", ["wrong password", "unknown vhost", "unreachable", "bad routing key"])
async def test_relay_start_exits_2_with_one_line_on_settings_no_retry_can_fix(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, amqp: AmqpService, fault: str
) -> None:
    secret = "n0t-the-Passw0rd"
    url, extra, expected = {
        "wrong password": (amqp.with_password(secret), [], "login refused for user 'guest'"),
        "unknown vhost": (amqp.with_path("relay-test-nope"), [], "refused to open virtual host 'relay-test-nope'"),
        "unreachable": (f"amqp://guest:{secret}@127.0.0.1:{closed_port()}/", [], "unreachable"),
        "bad routing key": (amqp.with_password(secret), ["--routing-key", "{tenant}.{event_type}"], "{tenant}"),
    }[fault]
    started = time.monotonic()
    proc = await asyncio.to_thread(run_relay, "start", *relay_args(relay_dsn, names, url, *extra))
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("relay: "), err
    assert expected in err, err
    assert secret not in proc.stderr + proc.stdout
    if fault != "bad routing key":
        assert err.startswith("relay: cannot connect to RabbitMQ at amqp://"), err
        assert elapsed >= 1.5, "gave up without retrying"
