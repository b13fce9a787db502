"""Both ends of the pipe under fire, for a consumer given as a command: the orders service
(tests/orders_app.py, under uvicorn) writes orders and their events through
``relay.Outbox`` under concurrent HTTP load, producers that lock the order and producers
that do not; `relay start` processes deliver them to RabbitMQ and are SIGKILLed every
1-2 s; the consumer process is SIGKILLed every 3-6 s and started again.

The oracle is outside the relay and the inbox: what the service committed (its
``order_history``, written in each request's transaction), each order's commit order (the
versions read under the lock; the order in which the test issued the unlocked producers'
COMMITs, one at a time), against the consumer's own record of what it applied, in the
order it applied it.

tests/test_pipeline_inbox.py runs tests/orders_consumer.py (``relay.Inbox``) through it,
tests/test_consumer_example.py examples/consumer.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg import sql

from relay.db.names import OutboxNames
from tests.conftest import Roles
from tests.deliveries import ORDERED, store_fleet_ordering
from tests.pg_clusters import free_port
from tests.relay_process import RelayProcess, relay_env, wait_until_async

ROOT = Path(__file__).resolve().parent.parent
ORDERED_TYPES = ("OrderPlaced", "OrderItemAdded", "OrderNoted")
# (ref, order id, event type, version, aggregate_seq) of one applied effect.
Effect = tuple[str, str, str, "int | None", "int | None"]


@dataclass
class Oracle:
    """What the test saw the service commit, per order: the refs of its ordered events in
    commit order (unlocked orders) or the order ids whose commit order is their versions."""

    unlocked: dict[int, list[str]] = field(default_factory=dict)
    locked: list[int] = field(default_factory=list)
    requests: int = 0
    rollbacks: int = 0


@dataclass
class Figures:
    """What the consumer applied against what was committed."""

    committed: int
    applied: int
    duplicates: int
    missing: int
    not_committed: int
    out_of_order: int
    relay_kills: int
    consumer_kills: int

    def __str__(self) -> str:
        return (
            f"committed {self.committed}, applied {self.applied} (duplicates {self.duplicates}, missing"
            f" {self.missing}, never committed {self.not_committed}), orders out of order {self.out_of_order};"
            f" {self.relay_kills} relay and {self.consumer_kills} consumer SIGKILLs"
        )


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


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
async def orders_service(
    pg_dsn: str, producer_dsn: str, names: OutboxNames, roles: Roles, tmp_path: Path
) -> AsyncIterator[str]:
    """The orders service under uvicorn, as the producer role; its base URL."""
    _service_tables(pg_dsn, names, roles)
    port = free_port()
    env = {**os.environ, "ORDERS_DSN": producer_dsn, "ORDERS_SCHEMA": names.schema, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "uvicorn", "tests.orders_app:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = start_process([*args, "--log-level", "warning"], env, tmp_path / "service.log")
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
        stop_process(proc)


async def locked_producer(
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


async def unlocked_producer(
    client: httpx.AsyncClient, url: str, oracle: Oracle, rng: random.Random, until: float
) -> None:
    """Rounds of transactions on the same orders, none locking anything: each round opens
    two to four on one or two orders, writes into them interleaved, then commits them one
    at a time, usually the last opened first."""
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


async def run_pipeline(
    *,
    url: str,
    pg_dsn: str,
    relay_dsn: str,
    names: OutboxNames,
    amqp_url: str,
    exchange: str,
    relays: list[RelayProcess],
    start_consumer: Callable[[], subprocess.Popen[bytes]],
    effects: Callable[[], list[Effect]],
    consumer_log: Path,
    kinds: tuple[str, ...],
    seconds: float,
    seed: int,
) -> Figures:
    """Load, kills, then the wait for the consumer to catch up; the figures, asserted."""
    store_fleet_ordering(pg_dsn, names)
    relay_environment = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="warning")

    def start_relay() -> None:
        relays.append(
            RelayProcess(
                "start", "--schema", names.schema, "--broker", "rabbitmq", "--amqp-url", amqp_url,
                "--exchange", exchange, "--routing-key", "orders", "--workers", "2", "--batch-size", "20",
                "--lease", "3s", "--publish-timeout", "2s", "--poll-interval", "100ms",
                "--ordering-default", "unordered", "--ordered", ORDERED,
                env=relay_environment,
            )
        )  # fmt: skip

    rng = random.Random(seed)
    oracle = Oracle()
    relay_kills = consumer_kills = 0
    consumers = [start_consumer()]

    async def chaos(until: float) -> None:
        nonlocal relay_kills, consumer_kills
        next_consumer_kill = time.monotonic() + rng.uniform(3, 6)
        while time.monotonic() < until:
            await asyncio.sleep(rng.uniform(1, 2))
            running = [r for r in relays if r.running()]
            if running:
                rng.choice(running).kill()
                relay_kills += 1
                start_relay()
            if time.monotonic() >= next_consumer_kill:
                stop_process(consumers[-1])
                consumer_kills += 1
                consumers.append(start_consumer())
                next_consumer_kill = time.monotonic() + rng.uniform(3, 6)

    try:
        start_relay()
        start_relay()
        until = time.monotonic() + seconds
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20), timeout=30) as client:
            load = []
            if "locked" in kinds:
                load += [locked_producer(client, url, oracle, random.Random(rng.random()), until) for _ in range(3)]
            if "unlocked" in kinds:
                load += [unlocked_producer(client, url, oracle, random.Random(rng.random()), until) for _ in range(2)]
            await asyncio.gather(*load, chaos(until))
        if not any(r.running() for r in relays):
            start_relay()
        if consumers[-1].poll() is not None:
            consumers.append(start_consumer())

        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            history = conn.execute(
                sql.SQL("SELECT ref::text, order_id, event_type, version FROM {}.order_history").format(
                    sql.Identifier(names.schema)
                )
            ).fetchall()

        def progress() -> str:
            logs = "".join(r.tail(5) for r in relays[-2:])
            consumer_tail = consumer_log.read_text(errors="replace")[-3000:]
            return f"{len(effects())} of {len(history)} applied; relays:\n{logs}\nconsumer:\n{consumer_tail}"

        settled = await wait_until_async(lambda: len(effects()) >= len(history), timeout=90, interval=0.5)
        assert settled, progress()
        await asyncio.sleep(1.0)  # anything applied twice late shows now
        applied = effects()
    finally:
        for proc in consumers:
            stop_process(proc)

    committed = {ref for ref, *_ in history}
    counts = Counter(ref for ref, *_ in applied)
    by_order: dict[str, list[tuple[str, int | None, int | None]]] = {}
    for ref, order_id, event_type, version, seq in applied:
        if event_type in ORDERED_TYPES:
            by_order.setdefault(order_id, []).append((ref, version, seq))
    out_of_order = set()
    for order_id in oracle.locked:
        mine = by_order.get(str(order_id), [])
        if [v for _r, v, _s in mine] != list(range(1, len(mine) + 1)):
            out_of_order.add(order_id)
    for order_id, refs in oracle.unlocked.items():
        if [ref for ref, _v, _s in by_order.get(str(order_id), [])] != refs:
            out_of_order.add(order_id)
    for order_id, mine in by_order.items():  # the relay's numbers, applied 1, 2, 3, ...
        if [s for _r, _v, s in mine] != list(range(1, len(mine) + 1)):
            out_of_order.add(int(order_id))
    figures = Figures(
        committed=len(committed),
        applied=len(applied),
        duplicates=sum(n - 1 for n in counts.values() if n > 1),
        missing=len(committed - set(counts)),
        not_committed=len(set(counts) - committed),
        out_of_order=len(out_of_order),
        relay_kills=relay_kills,
        consumer_kills=consumer_kills,
    )
    print(f"\npipeline ({', '.join(kinds)}, {seconds:.0f} s): {figures}")
    assert (figures.duplicates, figures.missing, figures.not_committed, figures.out_of_order) == (0, 0, 0, 0), (
        figures,
        sorted(out_of_order)[:10],
    )
    # The test did what it says: load of each kind, crashes on both sides.
    assert relay_kills >= seconds // 2 and consumer_kills >= 1, figures
    if "locked" in kinds:
        assert len(oracle.locked) >= 5 and sum(1 for *_, v in history if v and v > 1) >= 20
    if "unlocked" in kinds:
        assert sum(len(refs) - 1 for refs in oracle.unlocked.values()) >= 20 and oracle.rollbacks >= 1
    return figures


def read_rows(dsn: str, query: sql.Composable) -> list[Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchall()
