"""Fault injection: several real `relay start` processes over a real PostgreSQL and
RabbitMQ, and a real consumer, while workers are killed, database sessions terminated,
producers commit out of id order without locks, and the broker goes away.

What every scenario asserts, from what the consumer read off the queue:
- every outbox id was delivered at least once;
- for ordered event types, the first delivery of each message came in the aggregate's
  order, which is (writing transaction, id): see README "Commit order";
- no row is dead that was not poisoned on purpose;
- duplicates are counted and printed (at-least-once allows them; consumers de-duplicate).

Run on its own with `make test-faults` (`pytest -m faults`; REPEAT=5 runs it five times).
The RabbitMQ scenarios stop and start the shared RabbitMQ application, so they must not
run beside other suites that use it. The SQS scenarios run against moto in server mode,
on a server of their own that the outage scenario stops and starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import boto3
import psycopg
import pytest
from psycopg import sql

from relay.sqlnames import OutboxNames
from tests import rabbitmq_broker, sqs_server
from tests.cli_proc import RELAY, relay_env
from tests.conftest import Db
from tests.helpers import terminate_relay_sessions
from tests.rabbitmq_broker import AmqpService, BrokerControl, Rabbit, unique
from tests.sqs_server import receive_all

# The broker fixtures live in tests/rabbitmq_broker.py.
amqp = rabbitmq_broker.amqp
ctl = rabbitmq_broker.ctl
rabbit = rabbitmq_broker.rabbit
# The SQS fixture lives in tests/sqs_server.py (it also sets the fake AWS credentials the
# relay processes inherit).
moto_endpoint = sqs_server.moto_endpoint

pytestmark = pytest.mark.faults

ORDERED = "Order*"


@dataclass
class Fleet:
    """The relay processes of one scenario, each a real `relay start`."""

    args: list[str]
    env: dict[str, str]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    started_at: dict[int, float] = field(default_factory=dict)
    killed: int = 0

    def start(self) -> None:
        # stdout is unused by the rabbitmq broker; logs go to stderr, kept for failures.
        proc = subprocess.Popen(
            [*start_relay_argv(), *self.args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        self.procs.append(proc)
        self.started_at[proc.pid] = time.monotonic()

    def kill_one(self, rng: random.Random) -> None:
        alive = [p for p in self.procs if p.poll() is None]
        if alive:
            victim = rng.choice(alive)
            victim.send_signal(signal.SIGKILL)  # no drain, no finalize: a crash
            victim.wait(timeout=10)
            self.killed += 1

    def stop(self) -> list[int]:
        # A SIGTERM while the interpreter is still importing takes Python's default action
        # (exit by signal, nothing claimed yet); give late starters time to install the drain.
        youngest = max(self.started_at.values(), default=0.0)
        time.sleep(max(0.0, youngest + 3.0 - time.monotonic()))
        codes = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            codes.append(p.returncode)
        return codes

    def running_codes(self) -> list[int]:
        """Exit codes of the processes that were still running when stopped (SIGTERM: 0)."""
        return [p.returncode for p in self.procs if p.returncode != -signal.SIGKILL]


def start_relay_argv() -> list[str]:
    return [RELAY, "start"]


@pytest.fixture
def fleet_factory(amqp: AmqpService, pg_dsn: str) -> Iterator[Any]:
    fleets: list[Fleet] = []

    def make(names: OutboxNames, exchange: str, **extra: str) -> Fleet:
        args = [
            "--schema",
            names.schema,
            "--broker",
            "rabbitmq",
            "--exchange",
            exchange,
            "--routing-key",
            "outbox",
            "--workers",
            "2",
            "--batch-size",
            "20",
            "--lease",
            "3s",
            "--publish-timeout",
            "1s",
            "--poll-interval",
            "200ms",
            "--backoff-base",
            "100ms",
            "--backoff-cap",
            "1s",
            "--max-attempts",
            "3",
            "--ordering-default",
            "unordered",
            "--ordered",
            ORDERED,
            "--shutdown-grace",
            "5s",
        ]
        for key, value in extra.items():
            args += [f"--{key.replace('_', '-')}", value]
        fleet = Fleet(args, relay_env(RELAY_DSN=pg_dsn, RELAY_AMQP_URL=amqp.url, RELAY_LOG_LEVEL="warning"))
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()


@dataclass(frozen=True)
class Delivery:
    outbox_id: int
    aggregate_id: str
    event_type: str
    lease_version: int


async def read_queue(amqp: AmqpService, queue: str, expected_ids: set[int], timeout: float = 60) -> list[Delivery]:
    """Everything on ``queue`` in arrival order, until every expected id has arrived."""
    connection = await aio_pika.connect_robust(amqp.url, client_properties={"connection_name": unique("consumer")})
    got: list[Delivery] = []
    seen: set[int] = set()
    done = asyncio.Event()

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        h = message.headers
        d = Delivery(int(h["outbox_id"]), str(h["aggregate_id"]), str(h["event_type"]), int(h["lease_version"]))
        got.append(d)
        seen.add(d.outbox_id)
        await message.ack()
        if expected_ids <= seen:
            done.set()

    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=500)
        q = await channel.get_queue(queue, ensure=False)
        await q.consume(on_message)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
        await asyncio.sleep(0.5)  # let duplicates still in the queue arrive too
    finally:
        await connection.close()
    return got


def expected_order(db: Db) -> dict[str, list[int]]:
    """Per aggregate, the ordered rows in the order the relay promises: (xid, id)."""
    cur = db.conn.execute(
        sql.SQL("SELECT aggregate_id, id FROM {} WHERE ordered ORDER BY aggregate_id, xid, id").format(db.table)
    )
    order: dict[str, list[int]] = {}
    for aggregate_id, oid in cur.fetchall():
        order.setdefault(aggregate_id, []).append(oid)
    return order


def check_deliveries(db: Db, deliveries: list[Delivery], *, poisoned: frozenset[int] = frozenset()) -> Counter[int]:
    ids = {r["id"] for r in db.rows()}
    delivered = Counter(d.outbox_id for d in deliveries)
    missing = ids - set(delivered) - poisoned
    assert not missing, f"{len(missing)} outbox ids never delivered, e.g. {sorted(missing)[:5]}"
    first_seen: list[Delivery] = []
    seen: set[int] = set()
    for d in deliveries:
        if d.outbox_id not in seen:
            seen.add(d.outbox_id)
            first_seen.append(d)
    for aggregate_id, want in expected_order(db).items():
        got = [d.outbox_id for d in first_seen if d.aggregate_id == aggregate_id and d.outbox_id in set(want)]
        assert got == [i for i in want if i not in poisoned], (
            f"aggregate {aggregate_id}: first deliveries {got} != {want}"
        )
    dead = {r["id"] for r in db.rows() if r["status"] == "dead"}
    assert dead == set(poisoned), f"unexpected dead rows: {sorted(dead - set(poisoned))[:5]}"
    duplicates = Counter({i: n - 1 for i, n in delivered.items() if n > 1})
    print(
        f"\n  delivered {len(delivered)} ids, {sum(duplicates.values())} duplicate deliveries of {len(duplicates)} ids"
    )
    return duplicates


def produce_interleaved(pg_dsn: str, names: OutboxNames, aggregates: int, rounds: int, seed: int) -> int:
    """Producers writing the same aggregates from concurrent transactions without locking
    them; in every round the transaction that took the lower ids commits last."""
    table = sql.Identifier(names.schema, names.table)
    insert = sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, %s)"
    ).format(table)
    rng = random.Random(seed)
    written = 0
    with psycopg.connect(pg_dsn) as first, psycopg.connect(pg_dsn) as second:
        for r in range(rounds):
            chosen = rng.sample(range(aggregates), k=min(5, aggregates))
            for agg in chosen:
                first.execute(insert, (f"order-{agg}", "OrderUpdated", f'{{"round": {r}, "by": "first"}}'))
                first.execute(insert, (f"order-{agg}", "EmailQueued", f'{{"round": {r}}}'))
            for agg in chosen:
                second.execute(insert, (f"order-{agg}", "OrderUpdated", f'{{"round": {r}, "by": "second"}}'))
            second.commit()  # the higher ids commit first...
            time.sleep(rng.uniform(0.05, 0.25))  # long enough for a relay to deliver the later rows first
            first.commit()  # ...and the lower ids after them
            written += 3 * len(chosen)
    return written


async def run_chaos(fleet: Fleet, rng: random.Random, pg_dsn: str, db: Db, *, seconds: float) -> int:
    """For ``seconds``, every 0.5-1.5 s: SIGKILL a relay (and start another), or kill one
    blocked between publish and finalize, or terminate every relay database session.
    Returns how many leased rows were held at kills between publish and finalize."""
    stranded = 0
    chaos_until = time.monotonic() + seconds
    while time.monotonic() < chaos_until:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        action = rng.random()
        if action < 0.35:
            fleet.kill_one(rng)
            fleet.start()
        elif action < 0.6:
            # Hold the leased rows' locks so every worker that has published blocks in its
            # finalize, then kill one of them.
            with psycopg.connect(pg_dsn) as blocker:
                stranded += len(
                    blocker.execute(
                        sql.SQL("SELECT id FROM {} WHERE status = 'processing' FOR UPDATE").format(db.table)
                    ).fetchall()
                )
                await asyncio.sleep(0.5)
                fleet.kill_one(rng)
                blocker.rollback()
            fleet.start()
        else:
            terminate_relay_sessions(pg_dsn)
    return stranded


async def wait_all_done(db: Db, total: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while db.statuses() != {"done": total} and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    assert db.statuses() == {"done": total}, db.statuses()


async def test_crashes_killed_sessions_and_unlocked_producers(
    pg_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, amqp: AmqpService, fleet_factory: Any
) -> None:
    # A new schedule of faults every run; RELAY_FAULT_SEED replays one.
    seed = int(os.environ.get("RELAY_FAULT_SEED") or random.randrange(1 << 30))
    print(f"\n  fault schedule seed {seed} (RELAY_FAULT_SEED={seed} replays it)")
    rng = random.Random(seed)
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    fleet: Fleet = fleet_factory(names, exchange)
    for _ in range(3):
        fleet.start()

    written: list[int] = []
    producer = threading.Thread(
        target=lambda: written.append(produce_interleaved(pg_dsn, names, aggregates=30, rounds=40, seed=rng.random()))
    )
    producer.start()
    stranded = await run_chaos(fleet, rng, pg_dsn, db, seconds=12)
    producer.join()
    await wait_all_done(db, written[0])
    fleet.stop()
    assert all(code == 0 for code in fleet.running_codes()), fleet.running_codes()
    assert fleet.killed >= 3

    deliveries = await read_queue(amqp, queue, {r["id"] for r in db.rows()})
    duplicates = check_deliveries(db, deliveries)
    print(
        f"  {fleet.killed} relays killed; {stranded} leased rows held at a kill between publish and finalize;"
        f" {sum(duplicates.values())} duplicates"
    )


async def test_broker_outage_longer_than_the_backoff_schedule_burns_nothing(
    pg_dsn: str,
    names: OutboxNames,
    db: Db,
    rabbit: Rabbit,
    amqp: AmqpService,
    ctl: BrokerControl,
    fleet_factory: Any,
) -> None:
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    before = db.insert((f"order-{i % 10}", "OrderPlaced" if i % 2 else "EmailQueued", {"i": i}) for i in range(100))
    fleet: Fleet = fleet_factory(names, exchange)
    for _ in range(2):
        fleet.start()
    await wait_all_done(db, 100, timeout=30)

    ctl.run("stop_app", timeout=60)
    try:
        # Written during the outage. With --max-attempts 3 and backoff capped at 1 s the
        # whole retry schedule is over in about 2 s; the outage lasts 8 s.
        during = db.insert((f"order-{i % 10}", "OrderPlaced" if i % 2 else "EmailQueued", {"i": i}) for i in range(60))
        await asyncio.sleep(8)
        rows = {r["id"]: r for r in db.rows()}
        assert all(rows[i]["status"] == "pending" for i in during), Counter(rows[i]["status"] for i in during)
        assert all(rows[i]["attempts"] == 0 for i in during), Counter(rows[i]["attempts"] for i in during)
    finally:
        ctl.run("start_app", timeout=120)

    await wait_all_done(db, 160, timeout=60)
    rows = {r["id"]: r for r in db.rows()}
    # No attempt was spent while the broker was down (checked above, at the end of the
    # outage). Once it is back, a publish that races RabbitMQ's own start-up can lose its
    # fresh connection and count once as retryable (seen in 1 of 6 runs), so at most 2.
    attempts = Counter(rows[i]["attempts"] for i in during)
    print(f"\n  attempts of the rows written during the outage, after it: {dict(attempts)}")
    assert set(attempts) <= {1, 2}, attempts
    fleet.stop()
    assert all(code == 0 for code in fleet.running_codes())

    deliveries = await read_queue(amqp, queue, set(before) | set(during))
    check_deliveries(db, deliveries)


async def test_poisoned_message_dies_and_blocks_only_its_aggregate(
    pg_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, amqp: AmqpService, fleet_factory: Any
) -> None:
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    # A body over the broker limit the relay is told about: permanent, sent to dead unsent.
    poison = db.insert([("order-p", "OrderPlaced", {"blob": "x" * 5000})])
    behind = db.insert([("order-p", "OrderPaid", {})])
    others = db.insert((f"order-{i}", "OrderPlaced", {}) for i in range(20))
    fleet: Fleet = fleet_factory(names, exchange, amqp_max_message_size="4096")
    fleet.start()
    deadline = time.monotonic() + 30
    while db.statuses().get("done", 0) < 20 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    fleet.stop()
    assert db.row(poison[0])["status"] == "dead"
    assert db.row(behind[0])["status"] == "pending"  # blocked behind its dead head
    deliveries = await read_queue(amqp, queue, set(others))
    assert {d.outbox_id for d in deliveries} == set(others)


# -- the same checks against SQS (moto in server mode), for the faults that apply --------


@pytest.fixture
def own_moto(moto_endpoint: str) -> Iterator[Any]:
    """A moto server of this test's own on a fixed port, which the test may stop and
    start again (moto keeps its queues in the process, so they survive)."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    holder = {"server": ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)}
    holder["server"].start()

    class Control:
        endpoint = f"http://127.0.0.1:{port}"

        def stop(self) -> None:
            holder["server"].stop()

        def start(self) -> None:
            holder["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            holder["server"].start()

    yield Control()
    with contextlib.suppress(Exception):
        holder["server"].stop()


def sqs_fleet(fleet_factory_env: dict[str, str], names: OutboxNames, queue_url: str, endpoint: str) -> Fleet:
    args = [
        "--schema", names.schema, "--broker", "sqs", "--queue-url", queue_url, "--endpoint-url", endpoint,
        "--region", "us-east-1", "--workers", "2", "--batch-size", "20", "--lease", "3s",
        "--publish-timeout", "2s", "--poll-interval", "200ms", "--backoff-base", "100ms", "--backoff-cap", "1s",
        "--max-attempts", "3", "--ordering-default", "unordered", "--ordered", ORDERED, "--shutdown-grace", "5s",
        "--sqs-read-timeout", "1s", "--sqs-connect-timeout", "500ms",
    ]  # fmt: skip
    return Fleet(args, fleet_factory_env)


def sqs_deliveries(client: Any, url: str) -> list[Delivery]:
    return [
        Delivery(
            m.outbox_id, m.attributes["aggregate_id"], m.attributes["event_type"], int(m.attributes["lease_version"])
        )
        for m in receive_all(client, url, idle_s=1.0)
    ]


async def test_sqs_crashes_killed_sessions_and_unlocked_producers(
    pg_dsn: str, names: OutboxNames, db: Db, own_moto: Any
) -> None:
    seed = int(os.environ.get("RELAY_FAULT_SEED") or random.randrange(1 << 30))
    print(f"\n  fault schedule seed {seed} (RELAY_FAULT_SEED={seed} replays it)")
    rng = random.Random(seed)
    client = boto3.client("sqs", endpoint_url=own_moto.endpoint, region_name="us-east-1")
    url = client.create_queue(QueueName=unique("faults") + ".fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    fleet = sqs_fleet(relay_env(RELAY_DSN=pg_dsn, RELAY_LOG_LEVEL="warning"), names, url, own_moto.endpoint)
    try:
        for _ in range(3):
            fleet.start()
        written: list[int] = []
        producer = threading.Thread(
            target=lambda: written.append(produce_interleaved(pg_dsn, names, aggregates=20, rounds=25, seed=seed))
        )
        producer.start()
        await run_chaos(fleet, rng, pg_dsn, db, seconds=10)
        producer.join()
        await wait_all_done(db, written[0])
    finally:
        fleet.stop()
    assert all(code == 0 for code in fleet.running_codes()), fleet.running_codes()
    check_deliveries(db, await asyncio.to_thread(sqs_deliveries, client, url))


async def test_sqs_outage_longer_than_the_backoff_schedule_burns_nothing(
    pg_dsn: str, names: OutboxNames, db: Db, own_moto: Any
) -> None:
    client = boto3.client("sqs", endpoint_url=own_moto.endpoint, region_name="us-east-1")
    url = client.create_queue(QueueName=unique("outage") + ".fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    fleet = sqs_fleet(relay_env(RELAY_DSN=pg_dsn, RELAY_LOG_LEVEL="warning"), names, url, own_moto.endpoint)
    try:
        fleet.start()
        before = db.insert((f"order-{i % 10}", "OrderPlaced" if i % 2 else "EmailQueued", {"i": i}) for i in range(40))
        await wait_all_done(db, 40, timeout=30)
        own_moto.stop()  # the endpoint refuses connections: SQS is unreachable
        try:
            during = db.insert(
                (f"order-{i % 10}", "OrderPlaced" if i % 2 else "EmailQueued", {"i": i}) for i in range(30)
            )
            await asyncio.sleep(8)  # the whole retry schedule (--max-attempts 3, cap 1 s) is about 2 s
            rows = {r["id"]: r for r in db.rows()}
            assert all(rows[i]["status"] == "pending" for i in during), Counter(rows[i]["status"] for i in during)
            assert all(rows[i]["attempts"] == 0 for i in during), Counter(rows[i]["attempts"] for i in during)
        finally:
            own_moto.start()
        await wait_all_done(db, 70, timeout=60)
        rows = {r["id"]: r for r in db.rows()}
        assert all(rows[i]["attempts"] == 1 for i in during)
    finally:
        fleet.stop()
    assert all(code == 0 for code in fleet.running_codes())
    deliveries = await asyncio.to_thread(sqs_deliveries, client, url)
    assert {d.outbox_id for d in deliveries} >= set(before) | set(during)
    check_deliveries(db, deliveries)
