"""Database-leg benchmarks: outbox-relay beside the design reference's queries, same run.

The baseline is written to the design reference's description: its schema and indexes,
its claim (one statement with the expired-lease OR, plus its reaper), its ordered claim
(head-of-aggregate NOT EXISTS over an index on (aggregate_id, id)), and one fenced
finalize transaction per message. Both sides run the same Python loop shape, the same
data and the same number of workers, with a publisher that does nothing, so what differs
is the SQL and how often it commits.

    .venv/bin/python scripts/bench_db.py                # defaults finish in a few minutes
    .venv/bin/python scripts/bench_db.py --quick        # small sizes, for a smoke run

Prints one table; `--markdown` prints it as a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.config import CORE_OPTIONS, START_OPTIONS, RelaySettings
from relay.contract import Outcome
from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.session import configure_session, open_pool
from relay.db.settings import SettingsUpdate, store_ordering, update_settings
from relay.message import OutboxMessage
from relay.options import resolve
from relay.ordering import OrderingMap
from relay.runner import run_relay
from relay.worker import Worker, WorkerConfig
from scripts.procstat import CpuMeter
from scripts.reference_schema import REFERENCE_DDL

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
RELAY_SCHEMA = "bench_relay"
BASE_SCHEMA = "bench_reference"
LEASE = timedelta(seconds=60)
MAX_ATTEMPTS = 12

# -- the baseline: the design reference's schema and queries --------------------------


BASE_REAP = """
UPDATE {t} SET status = 'dead', last_error = 'lease expired after max attempts (worker crash?)',
       lease_owner = NULL, lease_until = NULL
 WHERE status = 'processing' AND lease_until < now() AND attempts >= %(max_attempts)s"""

BASE_CLAIM = """
WITH picked AS (
    SELECT id FROM {t}
     WHERE (status = 'pending' AND available_at <= now())
        OR (status = 'processing' AND lease_until < now() AND attempts < %(max_attempts)s)
     ORDER BY id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
UPDATE {t} AS o SET status = 'processing', lease_owner = %(owner)s, lease_until = now() + %(lease)s,
       lease_version = o.lease_version + 1, attempts = o.attempts + 1
  FROM picked WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_id, o.event_type, o.payload"""

BASE_CLAIM_ORDERED = """
WITH picked AS (
    SELECT o.id FROM {t} AS o
     WHERE ((o.status = 'pending' AND o.available_at <= now())
         OR (o.status = 'processing' AND o.lease_until < now() AND o.attempts < %(max_attempts)s))
       AND NOT EXISTS (SELECT 1 FROM {t} AS prev
                        WHERE prev.aggregate_id = o.aggregate_id AND prev.id < o.id
                          AND prev.status IN ('pending', 'processing', 'dead'))
     ORDER BY o.id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
UPDATE {t} AS o SET status = 'processing', lease_owner = %(owner)s, lease_until = now() + %(lease)s,
       lease_version = o.lease_version + 1, attempts = o.attempts + 1
  FROM picked WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_id, o.event_type, o.payload"""

BASE_DONE = """
UPDATE {t} SET status = 'done', done_at = now(), last_error = NULL, lease_owner = NULL, lease_until = NULL
 WHERE id = %(id)s AND status = 'processing' AND lease_version = %(version)s"""

# The ceiling: the reference's schema with claims tuned to its indexes (pending rows only, in
# the pending index's order; expired leases left to the reaper) and every outcome of a batch
# in one fenced statement, as the relay finalizes. Ordered only by the head-of-aggregate
# claim in id order, without commit-order numbering: an upper bound for the relay's ordered
# legs, not a peer.
CEIL_CLAIM = """
WITH picked AS (
    SELECT o.id FROM {t} AS o
     WHERE o.status = 'pending' AND o.available_at <= now() {ordered}
     ORDER BY o.available_at, o.id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
UPDATE {t} AS o SET status = 'processing', lease_owner = %(owner)s, lease_until = now() + %(lease)s,
       lease_version = o.lease_version + 1, attempts = o.attempts + 1
  FROM picked WHERE o.id = picked.id
RETURNING o.id, o.lease_version, o.attempts, o.aggregate_id, o.event_type, o.payload"""
CEIL_HEAD = """
       AND NOT EXISTS (SELECT 1 FROM {t} AS prev
                        WHERE prev.aggregate_id = o.aggregate_id AND prev.id < o.id
                          AND prev.status IN ('pending', 'processing', 'dead'))"""
BASE_DONE_BATCH = """
UPDATE {t} AS o SET status = 'done', done_at = now(), last_error = NULL, lease_owner = NULL, lease_until = NULL
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS f(id, version)
 WHERE o.id = f.id AND o.status = 'processing' AND o.lease_version = f.version"""


def base_sql(text: str) -> sql.Composed:
    return sql.SQL(text).format(t=sql.Identifier(BASE_SCHEMA, "outbox"))


# -- setup ---------------------------------------------------------------------------


def reset(dsn: str, ordering: OrderingMap) -> None:
    """Fresh relay outbox (migrated, with this ordering map) and fresh baseline table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(RELAY_SCHEMA)))
    reset_base(dsn)

    async def prepare() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await migrate(aconn, OutboxNames(RELAY_SCHEMA))
            await store_ordering(aconn, OutboxNames(RELAY_SCHEMA), ordering, notify=False)

    asyncio.run(prepare())


def fill(
    dsn: str,
    *,
    rows: int,
    aggregates: int,
    status: str = "pending",
    event_type: str = "E",
    schemas: tuple[str, ...] = (RELAY_SCHEMA, BASE_SCHEMA),
) -> None:
    """The same rows into each table: ``rows`` spread over ``aggregates`` aggregates."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, done_at)"
                    " SELECT 'order', 'agg-' || (g %% %s), %s, jsonb_build_object('n', g, 'pad', repeat('x', 100)),"
                    " %s, CASE WHEN %s = 'done' THEN now() END FROM generate_series(1, %s) AS g"
                ).format(sql.Identifier(schema, "outbox")),
                (aggregates, event_type, status, status, rows),
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, "outbox")))


def reset_base(dsn: str) -> None:
    """A fresh, empty reference table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(BASE_SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(BASE_SCHEMA)))
        conn.execute(base_sql(REFERENCE_DDL))


def count_done(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE status = 'done'").format(sql.Identifier(schema, "outbox"))
        ).fetchone()
        return int(row[0]) if row else 0


# -- drain throughput ----------------------------------------------------------------


class NoopPublisher:
    name = "noop"

    def __init__(self) -> None:
        self.count = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        self.count += len(batch)
        return [None] * len(batch)


async def drain_relay(dsn: str, total: int, workers: int, batch: int) -> float:
    publisher = NoopPublisher()
    pool = await open_pool(dsn, size=workers)  # the pool `relay start` uses
    async with pool:
        store = OutboxStore(pool, OutboxNames(RELAY_SCHEMA))
        config = WorkerConfig(batch_size=batch, lease=LEASE)
        ws = [Worker(store=store, publisher=publisher, owner=f"bench:{i}", config=config) for i in range(workers)]

        async def loop(w: Worker) -> None:
            while publisher.count < total:
                if await w.run_once() == 0:
                    await asyncio.sleep(0.001)

        started = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in ws))
        return time.perf_counter() - started


async def drain_baseline(dsn: str, total: int, workers: int, batch: int, ordered: bool, batched: bool = False) -> float:
    claim_sql = base_sql(BASE_CLAIM_ORDERED if ordered else BASE_CLAIM)
    if batched:
        claim_sql = base_sql(CEIL_CLAIM.replace("{ordered}", CEIL_HEAD if ordered else ""))
    reap_sql, done_sql = base_sql(BASE_REAP), base_sql(BASE_DONE)
    batch_sql = base_sql(BASE_DONE_BATCH)
    done = 0

    async def loop(i: int) -> None:
        nonlocal done
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            params = {"batch": batch, "owner": f"base:{i}", "lease": LEASE, "max_attempts": MAX_ATTEMPTS}
            while done < total:
                async with conn.transaction():
                    await conn.execute(reap_sql, params)
                    cur = await conn.execute(claim_sql, params)
                    rows = sorted(await cur.fetchall())
                if not rows:
                    await asyncio.sleep(0.001)
                    continue
                if batched:  # publish (nothing), then one fenced statement for the batch
                    await conn.execute(batch_sql, {"ids": [r[0] for r in rows], "versions": [r[1] for r in rows]})
                    done += len(rows)
                    continue
                for row in rows:  # publish (nothing), then one fenced finalize transaction each
                    async with conn.transaction():
                        await conn.execute(done_sql, {"id": row[0], "version": row[1]})
                done += len(rows)

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(workers)))
    return time.perf_counter() - started


@dataclass
class Row:
    scenario: str
    relay: str
    baseline: str
    ratio: str
    goal: str


@dataclass(frozen=True)
class Drained:
    """One drain: its rate, and the CPU it cost per message in PostgreSQL's backends and in
    this process (the relay's Python, or the reference's loop)."""

    rate: float
    pg_us: float
    own_us: float

    def cell(self) -> str:
        return f"{self.rate:,.0f}/s (PG {self.pg_us:.0f} us, client {self.own_us:.0f} us)"


def drained(messages: int, run: Callable[[], float]) -> Drained:
    meter, own_before = CpuMeter("postgres").start(), time.process_time()
    seconds = run()
    pg_s, own_s = meter.stop(), time.process_time() - own_before
    return Drained(messages / seconds, pg_s / messages * 1e6, own_s / messages * 1e6)


def drain_scenario(
    dsn: str, *, ordered: bool, messages: int, aggregates: int, history: int, workers: int, batch: int
) -> list[Row]:
    ordering = OrderingMap(default_ordered=ordered)

    def load(schemas: tuple[str, ...]) -> None:
        if history:
            fill(dsn, rows=history, aggregates=aggregates * 10, status="done", schemas=schemas)
        fill(dsn, rows=messages, aggregates=aggregates, schemas=schemas)

    reset(dsn, ordering)
    load((RELAY_SCHEMA, BASE_SCHEMA))
    relay = drained(messages, lambda: asyncio.run(drain_relay(dsn, messages, workers, batch)))
    base = drained(messages, lambda: asyncio.run(drain_baseline(dsn, messages, workers, batch, ordered)))
    for schema in (RELAY_SCHEMA, BASE_SCHEMA):
        done = count_done(dsn, schema) - history
        assert done == messages, f"{schema}: {done} of {messages} done"
    # The batched ceiling on a fresh copy of the same rows.
    reset_base(dsn)
    load((BASE_SCHEMA,))
    ceiling = drained(
        messages, lambda: asyncio.run(drain_baseline(dsn, messages, workers, batch, ordered, batched=True))
    )
    done = count_done(dsn, BASE_SCHEMA) - history
    assert done == messages, f"ceiling: {done} of {messages} done"
    kind = "ordered" if ordered else "unordered"
    where = f"{history:,} done rows" if history else "fresh table"
    goal = "≥ 25,000/s and ≥ 7x" if not history else "—"
    label = f"drain, {kind}, {where} ({messages:,} msgs, {aggregates:,} aggs)"
    return [
        Row(label, relay.cell(), base.cell(), f"{relay.rate / base.rate:.1f}x", goal),
        Row(
            f"{label}, against the batched ceiling",
            relay.cell(),
            ceiling.cell(),
            f"{relay.rate / ceiling.rate:.2f}x",
            "≥ 0.8x" if ordered else "held",
        ),
    ]


# -- ordered claim latency -----------------------------------------------------------


async def claim_latency_relay(dsn: str, samples: int, batch: int) -> list[float]:
    """Time the relay's whole claim transaction (reap, ingest, both claims), rolled back."""
    names = OutboxNames(RELAY_SCHEMA)
    from relay.db.dispatch import DEFAULT_BATCH_BYTES, INGEST_TRANSACTIONS
    from relay.db.statements import named_queries

    q = {name: names.render(text) for name, text in named_queries().items()}
    params = {
        "owner": "bench",
        "lease": LEASE,
        "max_attempts": MAX_ATTEMPTS,
        "batch": batch,
        "budget": DEFAULT_BATCH_BYTES,  # as the relay's claims run: within its byte budget
        "oversize": True,
    }
    ingest = {"transactions": INGEST_TRANSACTIONS}
    out = []
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await configure_session(conn)  # as the relay's pool sets up each of its sessions
        # The first ingest numbers the whole backlog once; claims after it are what we time.
        await conn.execute(q["ingest_lock"])
        await conn.execute(q["ingest"], ingest)
        await conn.commit()
        for _ in range(samples):
            started = time.perf_counter()
            await conn.execute(q["reap_expired"], params)
            await conn.execute(q["ingest_lock"])
            await conn.execute(q["ingest"], ingest)
            cur = await conn.execute(q["claim"], params)
            got = len(await cur.fetchall())
            out.append(time.perf_counter() - started)
            await conn.rollback()
        assert got > 0, "the relay's ordered claim found nothing"
    return out


async def claim_latency_baseline(dsn: str, samples: int, batch: int) -> list[float]:
    params = {"owner": "bench", "lease": LEASE, "max_attempts": MAX_ATTEMPTS, "batch": batch}
    out = []
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for _ in range(samples):
            started = time.perf_counter()
            await conn.execute(base_sql(BASE_REAP), params)
            cur = await conn.execute(base_sql(BASE_CLAIM_ORDERED), params)
            got = len(await cur.fetchall())
            out.append(time.perf_counter() - started)
            await conn.rollback()
        assert got > 0, "the baseline's ordered claim found nothing"
    return out


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] * 1000


def _hot_backlog(dsn: str, hot: int) -> None:
    """One aggregate's backlog of ``hot`` messages, written before everyone else's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in (RELAY_SCHEMA, BASE_SCHEMA):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', 'hot', 'E', '{{}}' FROM generate_series(1, %s)"
                ).format(sql.Identifier(schema, "outbox")),
                (hot,),
            )


def _dead_heads(dsn: str, aggregates: int) -> None:
    """``aggregates`` aggregates, each a dead head with one message waiting behind it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in (RELAY_SCHEMA, BASE_SCHEMA):
            t = sql.Identifier(schema, "outbox")
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', 'blocked-' || (g %% %s), 'E', '{{}}' FROM generate_series(1, %s) AS g"
                ).format(t),
                (aggregates, aggregates * 2),
            )
            conn.execute(
                sql.SQL(
                    "UPDATE {} SET status = 'dead', last_error = 'poison' WHERE id IN"
                    " (SELECT min(id) FROM {} GROUP BY aggregate_id)"
                ).format(t, t)
            )


def latency_scenarios(dsn: str, *, samples: int, batch: int, history: int, hot: int, dead_heads: int) -> list[Row]:
    ordering = OrderingMap(default_ordered=True)
    # Each scenario adds its load, then the same 1,000 ready aggregates every one shares.
    setups: dict[str, Callable[[], None]] = {
        "fresh": lambda: None,
        f"{history:,} done rows": lambda: fill(dsn, rows=history, aggregates=10_000, status="done"),
        f"1 aggregate with {hot:,} backlog + 1,000 aggs": lambda: _hot_backlog(dsn, hot),
        f"{dead_heads:,} aggregates blocked by a dead head + 1,000 aggs": lambda: _dead_heads(dsn, dead_heads),
    }
    results: dict[str, tuple[list[float], list[float]]] = {}
    for name, setup in setups.items():
        reset(dsn, ordering)
        setup()
        fill(dsn, rows=1000, aggregates=1000)
        results[name] = (
            asyncio.run(claim_latency_relay(dsn, samples, batch)),
            asyncio.run(claim_latency_baseline(dsn, samples, batch)),
        )

    fresh_p50 = statistics.median(results["fresh"][0]) * 1000
    rows = []
    for name, (ours, base) in results.items():
        vs_fresh = pct(ours, 50) / fresh_p50
        rows.append(
            Row(
                f"ordered claim of {batch}, {name}: p50 / p99",
                f"{pct(ours, 50):.2f} / {pct(ours, 99):.2f} ms",
                f"{pct(base, 50):.2f} / {pct(base, 99):.2f} ms",
                f"{pct(base, 50) / pct(ours, 50):.1f}x faster; p50 {vs_fresh:.2f}x fresh",
                "≤ 2x fresh" if name != "fresh" else "—",
            )
        )
    return rows


# -- insert-to-publish latency -------------------------------------------------------


class StampingPublisher(NoopPublisher):
    def __init__(self) -> None:
        super().__init__()
        self.published_at: dict[int, float] = {}

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        now = time.time()
        for m in batch:
            self.published_at[m.id] = now
        return await super().publish(batch)


def produce(dsn: str, rate: float, seconds: float, producers: int, committed: dict[int, float]) -> None:
    """``producers`` threads, each inserting one message per transaction at rate/producers."""
    stop_at = time.monotonic() + seconds
    lock = threading.Lock()

    def one(i: int) -> None:
        interval = producers / rate
        with psycopg.connect(dsn, autocommit=True) as conn:
            nxt = time.monotonic()
            n = 0
            while time.monotonic() < stop_at:
                row = conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                        " VALUES ('order', %s, 'E', '{{}}') RETURNING id"
                    ).format(sql.Identifier(RELAY_SCHEMA, "outbox")),
                    (f"p{i}-{n % 50}",),
                ).fetchone()
                stamp = time.time()
                assert row is not None
                with lock:
                    committed[row[0]] = stamp
                n += 1
                nxt += interval
                time.sleep(max(0.0, nxt - time.monotonic()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


async def insert_to_publish(dsn: str, *, notify: bool, rate: float, seconds: float) -> tuple[float, float, int]:
    publisher = StampingPublisher()
    values = resolve((*CORE_OPTIONS, *START_OPTIONS), {}, {}, {})
    values.update(
        dsn=dsn,
        schema=RELAY_SCHEMA,
        broker="log",
        workers=2,
        notify=notify,
        poll_interval=timedelta(seconds=1),
        ordering_default="ordered",
    )
    settings = RelaySettings.from_values(values)
    # Wake-ups are a shared setting (the producers' trigger reads it): stored for this run,
    # and the relay's own notify says whether it LISTENs.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await update_settings(conn, OutboxNames(RELAY_SCHEMA), SettingsUpdate(notify=notify))
    stop = asyncio.Event()
    task = asyncio.create_task(run_relay(settings, publisher, stop))
    await asyncio.sleep(1.0)
    committed: dict[int, float] = {}
    await asyncio.to_thread(produce, dsn, rate, seconds, 4, committed)
    await asyncio.sleep(2.0)
    stop.set()
    await task
    lat = [publisher.published_at[i] - t for i, t in committed.items() if i in publisher.published_at]
    assert len(lat) == len(committed), f"{len(committed) - len(lat)} messages not published"
    return pct(lat, 50), pct(lat, 99), len(lat)


def latency_rows(dsn: str, *, rate: float, seconds: float) -> list[Row]:
    reset(dsn, OrderingMap())
    on = asyncio.run(insert_to_publish(dsn, notify=True, rate=rate, seconds=seconds))
    off = asyncio.run(insert_to_publish(dsn, notify=False, rate=rate, seconds=seconds))
    return [
        Row(
            f"insert-to-publish at {rate:.0f} msg/s, poll 1s: p50 / p99 ({on[2]:,} msgs)",
            f"wake-ups on: {on[0]:.1f} / {on[1]:.1f} ms",
            f"wake-ups off: {off[0]:.1f} / {off[1]:.1f} ms",
            f"{off[0] / on[0]:.0f}x lower p50",
            "p50 ≤ 20 ms, p99 ≤ 100 ms",
        )
    ]


# -- memory --------------------------------------------------------------------------


def memory_row(dsn: str, rows: int) -> Row:
    reset(dsn, OrderingMap(default_ordered=False))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'order', 'agg-' || (g %% 1000), 'E', jsonb_build_object('n', g, 'pad', repeat('x', 100))"
                " FROM generate_series(1, %s) AS g"
            ).format(sql.Identifier(RELAY_SCHEMA, "outbox")),
            (rows,),
        )
    relay = Path(sys.executable).with_name("relay")
    env = {**os.environ, "RELAY_DSN": dsn}
    started = time.perf_counter()
    proc = subprocess.Popen(
        [
            str(relay),
            "start",
            "--schema",
            RELAY_SCHEMA,
            "--broker",
            "log",
            "--workers",
            "4",
            "--log-level",
            "warning",
            "--no-notify",
        ],
        stdout=subprocess.DEVNULL,
        env=env,
    )
    peak_kb = 0
    while True:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak_kb = max(peak_kb, int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM")).split()[1]))
        except (FileNotFoundError, StopIteration):
            break
        if count_done(dsn, RELAY_SCHEMA) >= rows:
            break
        time.sleep(0.5)
    elapsed = time.perf_counter() - started
    proc.terminate()
    proc.wait(timeout=30)
    return Row(
        f"peak RSS of `relay start --broker log --workers 4` draining {rows:,} rows",
        f"{peak_kb / 1024:.0f} MB",
        f"(drained in {elapsed:.0f} s, {rows / elapsed:,.0f}/s incl. JSON to /dev/null)",
        "—",
        "< 150 MB",
    )


# -- main ----------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--aggregates", type=int, default=5_000)
    ap.add_argument("--history", type=int, default=1_000_000)
    ap.add_argument("--hot", type=int, default=100_000)
    ap.add_argument("--dead-heads", type=int, default=10_000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--memory-rows", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--only", choices=["drain", "latency", "wakeup", "memory"], action="append")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run in well under a minute")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.messages, a.aggregates, a.history, a.hot, a.dead_heads = 5000, 500, 50_000, 10_000, 1000
        a.samples, a.seconds, a.memory_rows = 30, 3, 20_000
    only = set(a.only or ["drain", "latency", "wakeup", "memory"])
    rows: list[Row] = []
    steps: list[tuple[str, Callable[[], Any]]] = []
    if "drain" in only:

        def drain(ordered: bool, history: int) -> None:
            rows.extend(
                drain_scenario(
                    a.dsn,
                    ordered=ordered,
                    messages=a.messages,
                    aggregates=a.aggregates,
                    history=history,
                    workers=a.workers,
                    batch=a.batch,
                )
            )

        for history in sorted({0, a.history}):
            for ordered in (False, True):
                steps.append(("drain", functools.partial(drain, ordered, history)))
    if "latency" in only:
        steps.append(
            (
                "latency",
                lambda: rows.extend(
                    latency_scenarios(
                        a.dsn, samples=a.samples, batch=a.batch, history=a.history, hot=a.hot, dead_heads=a.dead_heads
                    )
                ),
            )
        )
    if "wakeup" in only:
        steps.append(("wakeup", lambda: rows.extend(latency_rows(a.dsn, rate=a.rate, seconds=a.seconds))))
    if "memory" in only:
        steps.append(("memory", lambda: rows.append(memory_row(a.dsn, a.memory_rows))))
    for name, step in steps:
        print(f"... {name}", file=sys.stderr, flush=True)
        step()
    with psycopg.connect(a.dsn) as conn:
        version = conn.execute("SHOW server_version").fetchone()
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" PostgreSQL {version[0] if version else '?'}; workers={a.workers}, batch={a.batch}\n"
    )
    header = Row("scenario", "outbox-relay", "reference baseline", "ratio", "goal")
    table = [header, *rows]
    if a.markdown:
        for i, r in enumerate(table):
            print("| " + " | ".join((r.scenario, r.relay, r.baseline, r.ratio, r.goal)) + " |")
            if i == 0:
                print("|---|---|---|---|---|")
    else:
        widths = [max(len(getattr(r, f)) for r in table) for f in ("scenario", "relay", "baseline", "ratio", "goal")]
        for r in table:
            cells = (r.scenario, r.relay, r.baseline, r.ratio, r.goal)
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    with psycopg.connect(a.dsn, autocommit=True) as conn:
        for schema in (RELAY_SCHEMA, BASE_SCHEMA):
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    main()
