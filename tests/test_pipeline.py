"""Pipelined dispatch: a worker claims its next batch while the current one publishes.

The batch claimed ahead is made real by a slow broker at the network boundary: a TCP
proxy between the relay and RabbitMQ holds every frame from the broker (the publisher
confirms) for a second, so each publish takes that long and the next batch sits leased
meanwhile. Each scenario first waits until the database shows it (one relay worker, rows
leased in two batches, two claim times) and fails if it never does.

The order oracle is the producers' commit log (tests/producers.py), producers that lock
their aggregates and producers that do not; the broker's received order is checked
against it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from psycopg import sql

from relay import BrokerUnavailable
from relay.breaker import CircuitBreaker
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.testing import STALL, InMemoryPublisher
from relay.worker import RELEASED_BROKER_REFUSED, Shared, Worker, WorkerConfig
from tests.conftest import Db
from tests.deliveries import ORDERED, check_deliveries, read_queue, store_fleet_ordering
from tests.helpers import make_worker
from tests.producers import producers_of_kind
from tests.rabbitmq_broker import AmqpService, Rabbit, TcpProxy
from tests.relay_process import RelayProcess, relay_env, wait_until_async

# How long the proxy holds the broker's frames: each publish waits this long for its
# confirms, the window in which the next batch is leased and waiting.
CONFIRM_LATENCY_S = 1.0
# How many aggregates and transactions (or rounds) each kind of producer writes.
PRODUCERS = {"locked": {"aggregates": 12, "transactions": 40}, "unlocked": {"aggregates": 8, "transactions": 40}}


@dataclass(frozen=True)
class InFlight:
    """What the database showed while a relay held two batches."""

    batches: list[list[int]]  # ids leased by the relay, per claim, earliest claim first
    statuses: dict[int, str]  # every row's status at that moment
    aggregates: dict[int, str]
    ordered: set[int]  # ids of ordered event types among them


def relay_args(names: OutboxNames, exchange: str, url: str) -> list[str]:
    return [
        "--schema", names.schema, "--broker", "rabbitmq", "--amqp-url", url,
        "--exchange", exchange, "--routing-key", "outbox",
        "--workers", "1", "--batch-size", "10",
        "--lease", "5s", "--publish-timeout", "4s", "--poll-interval", "200ms",
        "--ordering-default", "unordered", "--ordered", ORDERED,
    ]  # fmt: skip


async def warm_up(db: Db, relay: RelayProcess) -> None:
    """One message through the relay before the proxy slows down: its channel is open and
    proven, so each later publish waits one round trip, the confirms'."""
    [oid] = db.insert([("warm-up", "WarmedUp", {})])
    assert await wait_until_async(lambda: db.row(oid)["status"] == "done" or not relay.running(), timeout=30)
    assert relay.running(), f"relay exited:\n{relay.tail()}"


async def two_batches_in_flight(db: Db, relay: RelayProcess, timeout: float = 60) -> InFlight:
    """Wait until the relay's one worker holds rows of two claims (two lease times), the
    same two in two looks 100 ms apart: a batch publishing and the batch claimed ahead,
    not a batch caught for the moment its outcomes are written."""
    owner_like = f"%:{relay.pid}:0"
    query = sql.SQL(
        "SELECT id, status, aggregate_id, ordered, lease_until,"
        " status = 'processing' AND lease_owner LIKE %s AS ours FROM {} ORDER BY id"
    ).format(db.table)
    deadline = time.monotonic() + timeout
    previous: list[list[int]] = []
    while time.monotonic() < deadline:
        assert relay.running(), f"relay exited:\n{relay.tail()}"
        rows = db.conn.execute(query, (owner_like,)).fetchall()
        claims: dict[Any, list[int]] = {}
        for oid, _status, _agg, _ordered, lease_until, ours in rows:
            if ours:
                claims.setdefault(lease_until, []).append(oid)
        batches = [claims[k] for k in sorted(claims)]
        if len(batches) == 2 and batches == previous:
            return InFlight(
                batches=batches,
                statuses={r[0]: r[1] for r in rows},
                aggregates={r[0]: r[2] for r in rows},
                ordered={r[0] for r in rows if r[3]},
            )
        previous = batches
        await asyncio.sleep(0.1)
    raise AssertionError("the relay never held a batch and a prefetched one at once: nothing was tested")


def assert_only_ready_heads(seen: InFlight, expected: dict[str, list[int]]) -> None:
    """Every ordered row of the two batches was its aggregate's head: each one before it in
    commit order was done already, so the prefetch took other aggregates, not the next
    event of an aggregate still in flight."""
    leased = [oid for batch in seen.batches for oid in batch if oid in seen.ordered]
    aggregates = [seen.aggregates[oid] for oid in leased]
    assert len(aggregates) == len(set(aggregates)), f"two ordered rows of one aggregate in flight: {leased}"
    for oid in leased:
        order = expected[seen.aggregates[oid]]
        before = order[: order.index(oid)]
        waiting = [p for p in before if seen.statuses.get(p) != "done"]
        assert not waiting, f"row {oid} leased while {waiting} before it in commit order were not done"


async def start_behind_slow_confirms(
    pg_dsn: str,
    relay_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    proxy: TcpProxy,
    relays: list[RelayProcess],
) -> tuple[str, str, dict[str, str], RelayProcess]:
    """A relay publishing through the proxy, warmed up, whose broker confirms from now on
    take CONFIRM_LATENCY_S: a batch stays in hand long enough for the next to be claimed
    ahead. Returns the exchange, the bound queue, the relays' environment and the relay."""
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    store_fleet_ordering(pg_dsn, names)
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="warning")
    relay = RelayProcess("start", *relay_args(names, exchange, proxy.url(amqp.url)), env=env)
    relays.append(relay)
    await warm_up(db, relay)
    proxy.latency = CONFIRM_LATENCY_S
    return exchange, queue, env, relay


# The unlocked producers' variant is extended (make test-all): make test keeps the
# producers the design reference prescribes; the prefetch's release does not depend on them.
@pytest.mark.parametrize("kind", ["locked", pytest.param("unlocked", marks=pytest.mark.extended)])
async def test_a_relay_killed_with_a_batch_in_hand_and_one_prefetched_loses_nothing_and_keeps_order(
    kind: str,
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    proxy: TcpProxy,
    relays: list[RelayProcess],
) -> None:
    exchange, queue, env, first = await start_behind_slow_confirms(
        pg_dsn, relay_dsn, names, db, rabbit, amqp, proxy, relays
    )
    log, producing = producers_of_kind(pg_dsn, producer_dsn, names, kind, 11, **PRODUCERS[kind])

    seen = await two_batches_in_flight(db, first)
    first.kill()  # no drain: both batches stay leased until their leases expire
    assert all(seen.batches), seen.batches

    proxy.latency = 0.0
    await asyncio.to_thread(producing.join)
    assert_only_ready_heads(seen, log.expected())
    second = RelayProcess("start", *relay_args(names, exchange, amqp.url), env=env)
    relays.append(second)
    total = len(db.rows())
    assert await wait_until_async(lambda: db.statuses() == {"done": total}, timeout=60), db.statuses()
    assert await asyncio.to_thread(second.stop) == 0, second.tail()

    deliveries = await read_queue(amqp, queue, {r["id"] for r in db.rows()})
    check_deliveries(db, deliveries, log.expected())
    # The killed relay's rows went back through their expired leases, not by a write.
    again = {oid for batch in seen.batches for oid in batch}
    assert all(r["lease_version"] >= 2 for r in db.rows() if r["id"] in again)


# The unlocked producers' variant is extended (make test-all): make test keeps the
# producers the design reference prescribes; the prefetch's release does not depend on them.
@pytest.mark.parametrize("kind", ["locked", pytest.param("unlocked", marks=pytest.mark.extended)])
async def test_sigterm_with_a_prefetched_batch_releases_it_and_exits_0(
    kind: str,
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    proxy: TcpProxy,
    relays: list[RelayProcess],
) -> None:
    exchange, queue, env, relay = await start_behind_slow_confirms(
        pg_dsn, relay_dsn, names, db, rabbit, amqp, proxy, relays
    )
    log, producing = producers_of_kind(pg_dsn, producer_dsn, names, kind, 5, **PRODUCERS[kind])
    await asyncio.to_thread(producing.join)  # a backlog: the claim ahead finds a full batch

    seen = await two_batches_in_flight(db, relay)
    # In a thread: the proxy runs on this event loop and must keep passing the confirms.
    assert await asyncio.to_thread(relay.stop) == 0, relay.tail()
    in_hand, ahead = seen.batches
    rows = {r["id"]: r for r in db.rows()}
    assert not [i for i, r in rows.items() if r["status"] == "processing"], "rows left leased after a clean stop"
    assert all(rows[i]["status"] == "done" for i in in_hand), [
        (i, rows[i]["status"], rows[i]["last_error"]) for i in in_hand
    ] + [relay.tail()]
    # The batch claimed ahead was handed back unpublished, its attempt refunded.
    for i in ahead:
        assert rows[i]["status"] == "pending", rows[i]
        assert rows[i]["attempts"] == 0 and rows[i]["last_error"] == "released unpublished at shutdown", rows[i]

    proxy.latency = 0.0
    second = RelayProcess("start", *relay_args(names, exchange, amqp.url), env=env)
    relays.append(second)
    assert await wait_until_async(lambda: db.statuses() == {"done": len(rows)}, timeout=60), db.statuses()
    assert await asyncio.to_thread(second.stop) == 0, second.tail()
    deliveries = await read_queue(amqp, queue, set(rows))
    check_deliveries(db, deliveries, log.expected())


# ---- in one process, over the in-memory publisher


async def run_until(worker: Worker, done: Any, timeout: float = 10) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        assert await wait_until_async(done, timeout), "condition not reached in time"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_prefetched_batch_whose_lease_has_nearly_run_out_is_not_published(store: OutboxStore, db: Db) -> None:
    ids = db.insert([(f"a{i}", "E", {}) for i in range(4)])
    # The first claim of every row stalls its publish until the deadline: the lease's,
    # 1 s - 0.1 s margin (the publish timeout allows more). The batch claimed ahead waits
    # that long behind it, so little of its lease is left: it must not be published then.
    worker, publisher = make_worker(
        store,
        lambda m: STALL if m.lease_version == 1 else None,
        batch_size=2,
        lease=timedelta(seconds=1),
        publish_timeout=timedelta(seconds=30),
    )
    await run_until(worker, lambda: db.statuses() == {"done": 4}, timeout=20)
    rows = {i: db.row(i) for i in ids}
    # The first batch spent an attempt on its timeout (published on its second claim, second
    # attempt); the batch claimed ahead got its attempt back (second claim, first attempt).
    first = {i for i, r in rows.items() if (r["lease_version"], r["attempts"]) == (2, 2)}
    ahead = {i for i, r in rows.items() if (r["lease_version"], r["attempts"]) == (2, 1)}
    assert len(first) == len(ahead) == 2, rows
    assert worker.stats.released == 2
    # (The in-memory publisher records a message when it is asked for it; a stall stops
    # the batch at its first message.)
    tried_on_first_claim = {m.id for m in publisher.attempts if m.lease_version == 1}
    assert tried_on_first_claim and tried_on_first_claim <= first, "the batch claimed ahead was published"


async def test_no_prefetch_while_the_broker_refuses_and_the_batch_ahead_goes_back(store: OutboxStore, db: Db) -> None:
    ids = db.insert([(f"a{i}", "E", {}) for i in range(30)])
    publisher = InMemoryPublisher(script=lambda m: BrokerUnavailable("broker down"), delay=0.3)
    config = WorkerConfig(batch_size=5, poll_interval=timedelta(milliseconds=20))
    worker = Worker(store=store, publisher=publisher, owner="w", config=config, shared=Shared(breaker=CircuitBreaker()))
    most_leased_while_open = 0

    def probes_ran() -> bool:
        # The first batch is refused whole and opens the breaker; the batch claimed during
        # its publish goes back unpublished; from then on only probes of one row run.
        nonlocal most_leased_while_open
        if worker.stats.released:
            leased = db.statuses().get("processing", 0)
            most_leased_while_open = max(most_leased_while_open, leased)
        return len(publisher.attempts) >= 7

    await run_until(worker, probes_ran, timeout=20)
    first = {m.id for m in publisher.attempts[:5]}
    rows = {r["id"]: r for r in db.rows()}
    released = {i for i, r in rows.items() if r["last_error"] == RELEASED_BROKER_REFUSED}
    assert worker.stats.released == 5 and len(released) + len(first) <= 10, (worker.stats, released)
    assert not released & first
    assert most_leased_while_open <= 1, "claimed more than a probe while the breaker was open"
    assert all(rows[i]["attempts"] == 0 for i in ids), "an outage spent an attempt"
    assert db.statuses().get("processing", 0) == 0
