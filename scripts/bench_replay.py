"""Replay benchmark: `relay replay` beside the live relay on the same data, and the live
relay's latency with and without a replay running, same RabbitMQ, same run.

    .venv/bin/python scripts/bench_replay.py                 # 20,000 ordered messages, 3 rounds
    .venv/bin/python scripts/bench_replay.py --unordered --messages 50000

Each round:

1. live: an outbox pre-filled with N events (``--aggregates`` aggregates, ordered per
   aggregate unless ``--unordered``) is drained by ``relay start --broker rabbitmq`` into a
   durable queue, timed from the first claim to the last row done (bench_rabbitmq's
   relay leg);
2. replay: the same N rows, now done, are published again by ``relay replay --from-id 1``
   into the same (purged) queue, timed from the command's start to its exit (the plan
   included) and checked by the queue's count;
3. latency: a live relay runs while producers insert ``--rate`` rows a second for
   ``--seconds``; each row's delivery latency is done_at - created_at by the database
   clock. Once alone; once beside a full-speed replay of the whole history (the N rows
   and the latency legs' rows before it), and once beside one at ``--replay-rate``,
   counting only the rows created while the replay ran.

It prints each figure, the replay/live throughput ratio, and the latency percentiles side
by side, then the medians. It needs PostgreSQL and RabbitMQ (defaults: the local test
services); its schema, exchange and queue are deleted at the end. Autovacuum is whatever
the server runs with (this machine's is off); the figures say the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.db.names import OutboxNames
from relay.ordering import OrderingMap
from scripts.bench_rabbitmq import (
    EVENT_TYPES,
    Topology,
    add_outbox_arguments,
    make_events,
    relay_bin,
    relay_run,
    seed_outbox,
)


def replay_run(args: argparse.Namespace, names: OutboxNames, exchange: str, rate: float | None = None) -> float:
    """Seconds `relay replay` of every done row took, start to exit (at most ``rate`` a second)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    log_path = Path(tempfile.gettempdir()) / "relay-bench-replay.log"
    command = [
        *relay_bin(), "replay", "--dsn", args.dsn, "--schema", names.schema, "--from-id", "1",
        "--broker", "rabbitmq", "--amqp-url", args.amqp_url, "--exchange", exchange, "--routing-key", "{event_type}",
        "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--log-level", "warning",
        *(("--rate", f"{rate:g}/s") if rate else ()),
    ]  # fmt: skip
    started = time.perf_counter()
    with log_path.open("w") as log:
        done = subprocess.run(command, stdout=log, stderr=log, env=env, timeout=600)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"relay replay exited {done.returncode}: {log_path.read_text()[-2000:]}")
    return took


def produce(dsn: str, names: OutboxNames, rate: float, seconds: float, first_event: int) -> None:
    """Insert ``rate`` rows a second for ``seconds``, one per transaction, as a service would."""
    insert = sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, %s)"
    ).format(sql.Identifier(names.schema, names.table))
    n = int(rate * seconds)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.monotonic()
        for i in range(n):
            due = started + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            k = first_event + i
            conn.execute(insert, (f"live-{k % 200}", EVENT_TYPES[k % len(EVENT_TYPES)], f'{{"live": {k}}}'))


def latencies(dsn: str, names: OutboxNames, after_id: int, window: tuple[float, float] | None = None) -> list[float]:
    """done_at - created_at of the rows after ``after_id`` that are done, those created
    inside ``window`` (Unix times) only when it is given."""
    query = sql.SQL(
        "SELECT extract(epoch FROM done_at - created_at)::float8 FROM {} WHERE id > %s AND status = 'done'"
        " AND (%s::float8 IS NULL OR created_at BETWEEN to_timestamp(%s::float8) AND to_timestamp(%s::float8))"
    ).format(sql.Identifier(names.schema, names.table))
    low, high = window or (None, None)
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [float(r[0]) for r in conn.execute(query, (after_id, low, low, high)).fetchall()]


def max_id(dsn: str, names: OutboxNames) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(max(id), 0) FROM {}").format(sql.Identifier(names.schema, names.table))
        ).fetchone()
    assert row is not None
    return int(row[0])


def percentiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return at(0.5), at(0.99), ordered[-1] * 1000


def latency_leg(
    args: argparse.Namespace, names: OutboxNames, exchange: str, replay: str, first: int
) -> tuple[str, float]:
    """The live relay's delivery latency while producers write: alone (``replay`` "none"),
    or beside a replay of the history ("full" speed, or "paced" at --replay-rate), counting
    only rows created while the replay ran. The line to print, and the p99 in ms."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    command = [
        *relay_bin(), "start", "--dsn", args.dsn, "--schema", names.schema, "--broker", "rabbitmq",
        "--amqp-url", args.amqp_url, "--exchange", exchange, "--routing-key", "{event_type}",
        "--workers", str(args.workers), "--log-level", "warning",
    ]  # fmt: skip
    after = max_id(args.dsn, names)
    relay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    window = None
    replay_took = None
    try:
        time.sleep(1.0)  # started and listening
        producer = threading.Thread(target=produce, args=(args.dsn, names, args.rate, args.seconds, first))
        producer.start()
        if replay != "none":
            time.sleep(0.5)  # the producers' rhythm first
            began = time.time()
            replay_took = replay_run(args, names, exchange, args.replay_rate if replay == "paced" else None)
            window = (began, time.time())
        producer.join()
        expected = int(args.rate * args.seconds)
        deadline = time.monotonic() + 30
        while len(latencies(args.dsn, names, after)) < expected and time.monotonic() < deadline:
            time.sleep(0.1)
        found = latencies(args.dsn, names, after, window)
    finally:
        relay.terminate()
        relay.wait(30)
    p50, p99, worst = percentiles(found)
    beside = "" if replay_took is None else f" created while the replay ran ({replay_took:.1f}s)"
    return f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms over {len(found):,} rows{beside}", p99


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="relay replay beside the live relay, same data, same RabbitMQ")
    add_outbox_arguments(p)
    p.add_argument("--unordered", action="store_true", help="route every event type through the unordered claim")
    p.add_argument("--rate", type=float, default=300.0, help="live rows per second in the latency leg")
    p.add_argument("--seconds", type=float, default=10.0, help="how long the latency leg's producers write")
    p.add_argument("--replay-rate", type=float, default=500.0, help="the paced replay's --rate in the latency leg")
    args = p.parse_args(argv)
    print(f"python {platform.python_version()}, {os.cpu_count()} CPUs", flush=True)
    return asyncio.run(bench(args))


async def bench(args: argparse.Namespace) -> int:
    ordered = not args.unordered
    events = make_events(args.messages, args.aggregates, args.payload_bytes)
    names = OutboxNames(schema=f"bench_replay_{uuid.uuid4().hex[:8]}", table="outbox")
    n = len(events)
    live_rates: list[float] = []
    replay_rates: list[float] = []
    quiet_p99: list[float] = []
    busy_p99: list[float] = []
    paced_p99: list[float] = []
    produced = 0
    async with Topology(args.amqp_url) as topology:
        try:
            for round_no in range(1, args.rounds + 1):
                await topology.purge()
                await seed_outbox(args.dsn, names, events, OrderingMap(default_ordered=ordered))
                took, cpu = await asyncio.to_thread(relay_run, args, names, topology.exchange, n, ordered)
                if await topology.count() < n:
                    raise SystemExit("the live relay lost messages")
                await topology.purge()
                replay_took = await asyncio.to_thread(replay_run, args, names, topology.exchange)
                replayed = await topology.count()
                if replayed != n:
                    raise SystemExit(f"replay published {replayed} of {n}")
                live_rate, replay_rate = n / took, n / replay_took
                live_rates.append(live_rate)
                replay_rates.append(replay_rate)
                p99s: dict[str, float] = {}
                lines = []
                for leg in ("none", "full", "paced"):
                    line, p99s[leg] = await asyncio.to_thread(
                        latency_leg, args, names, topology.exchange, leg, produced
                    )
                    produced += int(args.rate * args.seconds)
                    await topology.purge()
                    lines.append(line)
                quiet_p99.append(p99s["none"])
                busy_p99.append(p99s["full"])
                paced_p99.append(p99s["paced"])
                print(
                    f"round {round_no}: live relay {live_rate:,.0f} msg/s ({cpu}); replay {replay_rate:,.0f} msg/s"
                    f" (start to exit, plan included), ratio {replay_rate / live_rate:.2f}\n"
                    f"    live latency at {args.rate:,.0f} rows/s alone: {lines[0]}\n"
                    f"    beside a full-speed replay of the history: {lines[1]}; p99 ratio"
                    f" {p99s['full'] / p99s['none']:.2f}\n"
                    f"    beside a replay at --rate {args.replay_rate:g}/s: {lines[2]}; p99 ratio"
                    f" {p99s['paced'] / p99s['none']:.2f}; load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
        finally:
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(names.schema)))
    kind = "ordered" if ordered else "unordered"
    print(
        f"median over {args.rounds} rounds, N={n:,} ({kind}, {args.aggregates:,} aggregates, {args.payload_bytes}-byte"
        f" payloads, {args.workers} workers, batch {args.batch_size}): live relay"
        f" {statistics.median(live_rates):,.0f} msg/s, replay {statistics.median(replay_rates):,.0f} msg/s, ratio"
        f" {statistics.median(replay_rates) / statistics.median(live_rates):.2f}; live p99"
        f" {statistics.median(quiet_p99):.1f} ms alone, {statistics.median(busy_p99):.1f} ms beside a full-speed"
        f" replay, {statistics.median(paced_p99):.1f} ms beside one at {args.replay_rate:g}/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
