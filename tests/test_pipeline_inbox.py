"""Both ends of the pipe under fire: a FastAPI service (tests/orders_app.py, under uvicorn)
writes orders and their events through ``relay.Outbox`` (SQLAlchemy async) under
concurrent HTTP load (httpx); relays deliver them to RabbitMQ and are SIGKILLed every 1-2 s;
a consumer process (tests/orders_consumer.py) applies each event's effect to its own
database through ``relay.Inbox`` and is itself killed every 3-6 s.

The oracles come from outside the relay and the inbox:

* what was committed: the service's ``order_history``, written by the application in
  each request's transaction (a rolled-back transaction leaves nothing there);
* commit order per order: for producers that lock the order (``FOR UPDATE``) the
  version each transaction read under the lock; for producers that do not, the order in
  which this test issued their COMMITs, one at a time (against the id order, mostly);
* what was applied: the consumer's ``effects`` rows, which have no unique key, so an
  effect applied twice shows.

Every committed event is applied exactly once, and each order's ordered events in commit
order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import Inbox
from relay.db.names import OutboxNames
from tests.conftest import Roles
from tests.deliveries import ORDERED, store_fleet_ordering
from tests.pg_clusters import free_port
from tests.rabbitmq_broker import AmqpService, Rabbit
from tests.relay_process import RelayProcess, relay_env, wait_until_async

ROOT = Path(__file__).resolve().parent.parent
CONSUMER_DATABASE = "relay_test_consumer"
ORDERED_TYPES = ("OrderPlaced", "OrderItemAdded", "OrderNoted")


@dataclass
class Oracle:
    """What the test saw the service commit, per order: the refs of its ordered events in
    commit order (unlocked orders) or the order ids whose commit order is their versions."""

    unlocked: dict[int, list[str]] = field(default_factory=dict)
    locked: list[int] = field(default_factory=list)
    requests: int = 0
    rollbacks: int = 0


@dataclass
class Chaos:
    relay_kills: int = 0
    consumer_kills: int = 0


def _process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def consumer_db(pg_dsn: str) -> Iterator[tuple[str, str]]:
    """The consumer's own database (created once) and a schema of this test's in it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (CONSUMER_DATABASE,)).fetchone() is None:
            # The other xdist process may make it meanwhile.
            with contextlib.suppress(psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(CONSUMER_DATABASE)))
    dsn = make_conninfo(pg_dsn, dbname=CONSUMER_DATABASE)
    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.effects (applied bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref uuid NOT NULL,"
                " aggregate_id text NOT NULL, event_type text NOT NULL, version integer, event_id uuid NOT NULL)"
            ).format(sql.Identifier(schema))
        )
    with psycopg.connect(dsn) as conn:
        Inbox("inbox", schema).migrate(conn)
    yield dsn, schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def _service_tables(pg_dsn: str, names: OutboxNames, roles: Roles) -> None:
    schema = sql.Identifier(names.schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {s}.orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                " version integer NOT NULL DEFAULT 1);"
                " CREATE TABLE {s}.order_history (ref uuid PRIMARY KEY, order_id bigint NOT NULL,"
                " event_type text NOT NULL, version integer);"
                " GRANT SELECT, INSERT, UPDATE ON {s}.orders, {s}.order_history TO {p}"
            ).format(s=schema, p=sql.Identifier(roles.producer))
        )


@pytest.fixture
async def service(
    pg_dsn: str, producer_dsn: str, names: OutboxNames, roles: Roles, tmp_path: Path
) -> AsyncIterator[str]:
    """The orders service under uvicorn, as the producer role; its base URL."""
    _service_tables(pg_dsn, names, roles)
    port = free_port()
    env = {**os.environ, "ORDERS_DSN": producer_dsn, "ORDERS_SCHEMA": names.schema, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "uvicorn", "tests.orders_app:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = _process([*args, "--log-level", "warning"], env, tmp_path / "service.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        async with httpx.AsyncClient() as client:
            while True:
                assert proc.poll() is None, (tmp_path / "service.log").read_text()[-2000:]
                assert time.monotonic() < deadline, (tmp_path / "service.log").read_text()[-2000:]
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
        yield url
    finally:
        _stop(proc)


async def _locked_producer(
    client: httpx.AsyncClient, url: str, oracle: Oracle, rng: random.Random, until: float
) -> None:
    mine: list[int] = []
    while time.monotonic() < until:
        if not mine or rng.random() < 0.2:
            order = (await client.post(f"{url}/orders")).raise_for_status().json()
            mine.append(order["id"])
            oracle.locked.append(order["id"])
        else:
            (await client.post(f"{url}/orders/{rng.choice(mine)}/items")).raise_for_status()
        oracle.requests += 1


async def _unlocked_producer(
    client: httpx.AsyncClient, url: str, oracle: Oracle, rng: random.Random, until: float
) -> None:
    """Rounds of transactions on the same orders, none locking anything: each round opens
    two to four on one or two orders, writes into them interleaved (so each holds lower and
    higher ids), then commits them one at a time, usually the last opened first."""
    orders: list[int] = []
    for _ in range(3):
        order = (await client.post(f"{url}/orders")).raise_for_status().json()
        orders.append(order["id"])
        oracle.unlocked[order["id"]] = [order["ref"]]
    while time.monotonic() < until:
        opened: list[tuple[str, int]] = []
        for order_id in rng.sample(orders, k=rng.randint(1, 2)):
            for _ in range(rng.randint(2, 3)):
                token = (await client.post(f"{url}/orders/{order_id}/notes/hold")).raise_for_status().json()["token"]
                opened.append((token, order_id))
        for token, _order in rng.sample(opened, k=len(opened)):
            if rng.random() < 0.5:
                (await client.post(f"{url}/held/{token}/more")).raise_for_status()
        ending = opened[::-1] if rng.random() < 0.7 else rng.sample(opened, k=len(opened))
        for token, order_id in ending:
            if rng.random() < 0.1:
                (await client.post(f"{url}/held/{token}/rollback")).raise_for_status()
                oracle.rollbacks += 1
                continue
            refs = (await client.post(f"{url}/held/{token}/commit")).raise_for_status().json()["refs"]
            oracle.unlocked[order_id].extend(refs)
        oracle.requests += len(opened)


async def _chaos(
    start_relay: Any, start_consumer: Any, relays: list[RelayProcess], consumer: list[subprocess.Popen[bytes]],
    chaos: Chaos, rng: random.Random, until: float,
) -> None:  # fmt: skip
    """Kill one relay every 1-2 s (and start another), the consumer every 3-6 s."""
    next_consumer_kill = time.monotonic() + rng.uniform(3, 6)
    while time.monotonic() < until:
        await asyncio.sleep(rng.uniform(1, 2))
        running = [r for r in relays if r.running()]
        if running:
            victim = rng.choice(running)
            victim.kill()
            chaos.relay_kills += 1
            start_relay()
        if time.monotonic() >= next_consumer_kill:
            _stop(consumer[-1])
            chaos.consumer_kills += 1
            consumer.append(start_consumer())
            next_consumer_kill = time.monotonic() + rng.uniform(3, 6)


async def run_pipeline(
    *, url: str, pg_dsn: str, relay_dsn: str, names: OutboxNames, consumer_db: tuple[str, str], rabbit: Rabbit,
    amqp: AmqpService, relays: list[RelayProcess], tmp_path: Path, kinds: tuple[str, ...], seconds: float, seed: int,
) -> None:  # fmt: skip
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    store_fleet_ordering(pg_dsn, names)
    relay_environment = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="warning")

    def start_relay() -> None:
        relays.append(
            RelayProcess(
                "start", "--schema", names.schema, "--broker", "rabbitmq", "--amqp-url", amqp.url,
                "--exchange", exchange, "--routing-key", "outbox", "--workers", "2", "--batch-size", "20",
                "--lease", "3s", "--publish-timeout", "2s", "--poll-interval", "100ms",
                "--ordering-default", "unordered", "--ordered", ORDERED,
                env=relay_environment,
            )
        )  # fmt: skip

    consumer_dsn, consumer_schema = consumer_db
    consumer_env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CONSUMER_DSN": consumer_dsn,
        "CONSUMER_SCHEMA": consumer_schema,
        "CONSUMER_AMQP_URL": amqp.url,
        "CONSUMER_QUEUE": queue,
    }

    def start_consumer() -> subprocess.Popen[bytes]:
        return _process([sys.executable, "-m", "tests.orders_consumer"], consumer_env, tmp_path / "consumer.log")

    rng = random.Random(seed)
    oracle, chaos = Oracle(), Chaos()
    consumer = [start_consumer()]
    try:
        start_relay()
        start_relay()
        until = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=20)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            load = []
            if "locked" in kinds:
                load += [_locked_producer(client, url, oracle, random.Random(rng.random()), until) for _ in range(3)]
            if "unlocked" in kinds:
                load += [_unlocked_producer(client, url, oracle, random.Random(rng.random()), until) for _ in range(2)]
            await asyncio.gather(
                *load, _chaos(start_relay, start_consumer, relays, consumer, chaos, random.Random(seed), until)
            )
        if not any(r.running() for r in relays):
            start_relay()
        if consumer[-1].poll() is not None:
            consumer.append(start_consumer())

        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            history = conn.execute(
                sql.SQL("SELECT ref::text, order_id, event_type, version FROM {}.order_history").format(
                    sql.Identifier(names.schema)
                )
            ).fetchall()

        def effects() -> list[tuple[str, str, str, int | None]]:
            with psycopg.connect(consumer_dsn, autocommit=True) as conn:
                return conn.execute(
                    sql.SQL(
                        "SELECT ref::text, aggregate_id, event_type, version FROM {}.effects ORDER BY applied"
                    ).format(sql.Identifier(consumer_schema))
                ).fetchall()

        def progress() -> str:
            logs = "".join(r.tail(5) for r in relays[-2:])
            return f"{len(effects())} of {len(history)} effects applied; relays:\n{logs}"

        settled = await wait_until_async(lambda: len(effects()) >= len(history), timeout=90, interval=0.5)
        assert settled, progress()
        await asyncio.sleep(1.0)  # anything applied twice late shows now
        applied = effects()
    finally:
        for proc in consumer:
            _stop(proc)

    # Every committed event applied, exactly once; nothing that was not committed.
    committed = {ref for ref, *_ in history}
    counts = Counter(ref for ref, *_ in applied)
    assert sorted(r for r, n in counts.items() if n > 1) == []
    assert sorted(committed - set(counts)) == []
    assert sorted(set(counts) - committed) == []
    # Each order's ordered events in commit order.
    by_order: dict[str, list[tuple[str, int | None]]] = {}
    for ref, aggregate, event_type, version in applied:
        if event_type in ORDERED_TYPES:
            by_order.setdefault(aggregate, []).append((ref, version))
    for order_id in oracle.locked:
        versions = [v for _ref, v in by_order[str(order_id)]]
        assert versions == list(range(1, len(versions) + 1)), (order_id, versions)
    for order_id, refs in oracle.unlocked.items():
        assert [ref for ref, _v in by_order[str(order_id)]] == refs, order_id
    # The test did what it says: load of each kind, crashes on both sides.
    assert chaos.relay_kills >= seconds // 2 and chaos.consumer_kills >= 1, chaos
    if "locked" in kinds:
        assert len(oracle.locked) >= 5 and sum(1 for *_, v in history if v and v > 1) >= 20
    if "unlocked" in kinds:
        assert sum(len(refs) - 1 for refs in oracle.unlocked.values()) >= 20 and oracle.rollbacks >= 1


async def test_every_committed_event_is_applied_once_in_commit_order(
    service: str, pg_dsn: str, relay_dsn: str, names: OutboxNames, consumer_db: tuple[str, str], rabbit: Rabbit,
    amqp: AmqpService, relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """Locked and unlocked producers at once, for 8 s of load."""
    await run_pipeline(
        url=service, pg_dsn=pg_dsn, relay_dsn=relay_dsn, names=names, consumer_db=consumer_db, rabbit=rabbit,
        amqp=amqp, relays=relays, tmp_path=tmp_path, kinds=("locked", "unlocked"), seconds=8, seed=26,
    )  # fmt: skip


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["locked", "unlocked"])
async def test_every_committed_event_is_applied_once_in_commit_order_longer(
    kind: str, service: str, pg_dsn: str, relay_dsn: str, names: OutboxNames, consumer_db: tuple[str, str],
    rabbit: Rabbit, amqp: AmqpService, relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """One kind of producer at a time, for 40 s of load."""
    await run_pipeline(
        url=service, pg_dsn=pg_dsn, relay_dsn=relay_dsn, names=names, consumer_db=consumer_db, rabbit=rabbit,
        amqp=amqp, relays=relays, tmp_path=tmp_path, kinds=(kind,), seconds=40, seed=2601,
    )  # fmt: skip
