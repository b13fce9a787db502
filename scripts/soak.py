"""Soak: producers and relays delivering to RabbitMQ for a long time, with a relay killed
now and then, sampled every 10 s, to show what grows and whether it stops growing.

    .venv/bin/python scripts/soak.py --minutes 30 --rate 1000        # the BENCHMARKS.md run
    .venv/bin/python scripts/soak.py --minutes 3 --rate 200          # a smoke run

What runs:

- its own PostgreSQL cluster (``pg_createcluster`` on a free port, autovacuum ON, as in
  production; dropped at the end), unless ``--dsn`` names one (then the figures depend on
  that server's vacuum settings, which the output prints);
- ``--relays`` ``relay start`` processes with scheduled prune (``--prune-older-than``,
  ``--prune-interval``); every ``--kill-every`` one of them is SIGKILLed and started again
  (its leases expire and the others take its rows over);
- producers inserting ``--rate`` rows a second (one transaction per tick, spread over
  ``--aggregates`` aggregates; ordered and unordered event types), each payload carrying
  its insert time;
- a consumer acking everything from a durable queue; the delivery lag is its receive time
  minus the payload's insert time (what a consumer sees).

Every 10 s it samples: lag p50/p99 over those 10 s, the relays' RSS (largest), the
outbox's heap and index sizes, the heads and commits tables' sizes, dead tuples
(outbox, heads), autovacuum runs so far, and rows not yet done. At the end it prints, per
metric, the growth per hour (least squares over the samples after the warm-up) and a
verdict. **How it decides "grows without bound"**: after the warm-up (the first third of
the run, at least the prune window plus two prune intervals, so the table has reached
its retained size), the samples are split into two halves; a metric grows without bound
if the second half's median is more than ``--tolerance`` (25%) above the first half's
median (or above the metric's noise floor, :func:`noise_floors`, when that is higher) AND
its least-squares slope over the whole window is positive. A bounded metric
levels off: its halves agree. Exit code 1 when any metric grows without bound, or when a
row was lost or went to dead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.durations import parse_duration

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
SAMPLE_S = 10.0
EVENT_TYPES = ("OrderPlaced", "OrderPaid", "OrderShipped", "EmailSent")


def relay_bin() -> list[str]:
    script = Path(sys.executable).with_name("relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


# ---------------------------------------------------------------------------------------
# Its own PostgreSQL cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def own_cluster() -> Iterator[str]:
    """A PostgreSQL cluster of the machine's version on a free port, autovacuum on, trust
    on 127.0.0.1; dropped at the end whatever happens. Yields its DSN."""
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    name = f"relay_soak_{uuid.uuid4().hex[:6]}"
    port = free_port()
    subprocess.run(
        ["pg_createcluster", version, name, "-p", str(port), "--", "--auth=trust"], check=True, capture_output=True
    )
    try:
        conf = Path(f"/etc/postgresql/{version}/{name}/conf.d/soak.conf")
        conf.write_text(
            "listen_addresses = '127.0.0.1'\nautovacuum = on\nshared_buffers = 256MB\nmax_connections = 100\n"
        )
        subprocess.run(["pg_ctlcluster", version, name, "start"], check=True, capture_output=True)
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(["pg_dropcluster", "--stop", version, name], capture_output=True)


# ---------------------------------------------------------------------------------------
# Producers and the consumer


@dataclass
class Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    produced: int = 0
    received: int = 0
    seen: set[int] = field(default_factory=set)
    lags: list[float] = field(default_factory=list)  # since the last sample

    def take_lags(self) -> list[float]:
        with self.lock:
            lags, self.lags = self.lags, []
        return lags


def produce(dsn: str, table: sql.Composable, rate: float, aggregates: int, stop: threading.Event, c: Counters) -> None:
    """``rate`` rows a second, one transaction per 20 ms tick, until ``stop``."""
    insert = sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, %s)"
    ).format(table)
    rng = random.Random(1)
    tick = 0.02
    per_tick = rate * tick
    owed = 0.0
    with psycopg.connect(dsn) as conn:
        started = time.monotonic()
        n = 0
        while not stop.is_set():
            n += 1
            owed += per_tick
            rows = int(owed)
            owed -= rows
            with conn.cursor() as cur:
                cur.executemany(
                    insert,
                    [
                        (
                            f"order-{rng.randrange(aggregates)}",
                            EVENT_TYPES[rng.randrange(len(EVENT_TYPES))],
                            json.dumps({"t": time.time()}),
                        )
                        for _ in range(rows)
                    ],
                )
            conn.commit()
            with c.lock:
                c.produced += rows
            pause = started + n * tick - time.monotonic()
            if pause > 0:
                time.sleep(pause)


def consume(url: str, queue: str, stop: threading.Event, c: Counters) -> None:
    """Take everything from ``queue`` (auto-ack); record each message's lag and outbox id."""

    async def run() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=2000)
            q = await channel.get_queue(queue, ensure=False)

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                lag = time.time() - json.loads(message.body)["t"]
                with c.lock:
                    c.received += 1
                    c.seen.add(int(message.headers["outbox_id"]))
                    c.lags.append(lag)

            await q.consume(on_message, no_ack=True)
            # ``stop`` is a thread's event, set by the soak's main thread.
            await asyncio.to_thread(stop.wait)

    asyncio.run(run())


async def declare_queue(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)


async def delete_queue(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(queue)


# ---------------------------------------------------------------------------------------
# Relays


class Relays:
    def __init__(self, args: argparse.Namespace, dsn: str, schema: str, queue: str, logs: Path) -> None:
        self.command = [
            *relay_bin(), "start", "--dsn", dsn, "--schema", schema, "--broker", "rabbitmq",
            "--amqp-url", args.amqp_url, "--exchange", "", "--routing-key", queue,
            "--prune-older-than", args.prune_older_than, "--prune-interval", args.prune_interval,
            "--lease", "10s", "--publish-timeout", "5s", "--log-level", "warning",
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        self.logs = logs
        self.procs = [self._start(i) for i in range(args.relays)]
        self.kills = 0

    def _start(self, i: int) -> subprocess.Popen[bytes]:
        log = (self.logs / f"relay-{i}.log").open("ab")
        return subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=log, env=self.env)

    def kill_one(self) -> None:
        i = self.kills % len(self.procs)
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()
        self.procs[i] = self._start(i)
        self.kills += 1

    def rss_mb(self) -> float:
        """The largest relay's resident memory."""
        sizes = []
        for p in self.procs:
            try:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        sizes.append(int(line.split()[1]) / 1024)
            except FileNotFoundError:
                continue
        return max(sizes, default=0.0)

    def check_running(self) -> None:
        for i, p in enumerate(self.procs):
            if p.poll() is not None:
                tail = (self.logs / f"relay-{i}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"relay {i} exited with {p.returncode}:\n{tail}")

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


# ---------------------------------------------------------------------------------------
# Sampling and the verdict

METRICS = (
    ("lag_p50_ms", "delivery lag p50", "ms"),
    ("lag_p99_ms", "delivery lag p99", "ms"),
    ("relay_rss_mb", "relay RSS (largest)", "MB"),
    ("outbox_heap_mb", "outbox heap", "MB"),
    ("outbox_index_mb", "outbox indexes", "MB"),
    ("heads_mb", "heads table (with indexes)", "MB"),
    ("commits_mb", "commits table (with indexes)", "MB"),
    ("outbox_dead_tuples", "outbox dead tuples", ""),
    ("heads_dead_tuples", "heads dead tuples", ""),
    ("backlog", "rows not done", ""),
)


def sample(conn: psycopg.Connection[Any], schema: str, relays: Relays, lags: list[float]) -> dict[str, float]:
    def size(table: str, total: bool) -> float:
        fn = "pg_total_relation_size" if total else "pg_relation_size"
        row = conn.execute(f"SELECT {fn}(%s::regclass)", (f'"{schema}"."{table}"',)).fetchone()
        return float(row[0]) / 2**20 if row else 0.0

    def stat(table: str) -> tuple[float, float]:
        row = conn.execute(
            "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables WHERE schemaname = %s AND relname = %s",
            (schema, table),
        ).fetchone()
        return (float(row[0]), float(row[1])) if row else (0.0, 0.0)

    index_row = conn.execute("SELECT pg_indexes_size(%s::regclass)", (f'"{schema}"."outbox"',)).fetchone()
    backlog_row = conn.execute(
        sql.SQL("SELECT count(*) FROM {} WHERE status <> 'done'").format(sql.Identifier(schema, "outbox"))
    ).fetchone()
    outbox_dead, outbox_av = stat("outbox")
    heads_dead, heads_av = stat("outbox_heads")
    ordered = sorted(lags)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")

    return {
        "lag_p50_ms": pct(0.5),
        "lag_p99_ms": pct(0.99),
        "relay_rss_mb": relays.rss_mb(),
        "outbox_heap_mb": size("outbox", False),
        "outbox_index_mb": float(index_row[0]) / 2**20 if index_row else 0.0,
        "heads_mb": size("outbox_heads", True),
        "commits_mb": size("outbox_commits", True),
        "outbox_dead_tuples": outbox_dead,
        "heads_dead_tuples": heads_dead,
        "backlog": float(backlog_row[0]) if backlog_row else 0.0,
        "autovacuum_runs": outbox_av + heads_av,
    }


def slope_per_hour(times: list[float], values: list[float]) -> float:
    if len(times) < 2:
        return 0.0
    mt, mv = statistics.fmean(times), statistics.fmean(values)
    den = sum((t - mt) ** 2 for t in times)
    return 0.0 if den == 0 else sum((t - mt) * (v - mv) for t, v in zip(times, values, strict=True)) / den * 3600


def noise_floors(rate: float) -> dict[str, float]:
    """Per metric, the level below which a rise does not count as growth: what restarts
    and autovacuum's rhythm move it by anyway. The lag after a SIGKILL waits for the lease
    (10 s here) on the rows the killed relay held; dead tuples rise and fall with each
    autovacuum by a minute's writes or so; a few batches are always in flight."""
    return {
        "lag_p50_ms": 250.0,
        "lag_p99_ms": 250.0,
        "relay_rss_mb": 1.0,
        "outbox_heap_mb": 1.0,
        "outbox_index_mb": 1.0,
        "heads_mb": 1.0,
        "commits_mb": 1.0,
        "outbox_dead_tuples": rate * 60 * 3,  # three updates a row (claim, finalize, prune's delete)
        "heads_dead_tuples": rate * 60,
        "backlog": rate * 10,
    }


def verdicts(
    samples: list[dict[str, float]], warmup_s: float, tolerance: float, floors: dict[str, float]
) -> list[tuple[str, str, bool]]:
    window = [s for s in samples if s["t"] >= warmup_s]
    out = []
    for key, label, unit in METRICS:
        points = [(s["t"], s[key]) for s in window if s[key] == s[key]]  # NaN: no lag sample then
        if len(points) < 4:
            out.append((label, "too few samples", False))
            continue
        half = len(points) // 2
        first = statistics.median(v for _, v in points[:half])
        second = statistics.median(v for _, v in points[half:])
        slope = slope_per_hour([t for t, _ in points], [v for _, v in points])
        grows = slope > 0 and second > max(first, floors[key]) * (1 + tolerance)
        text = (
            f"{first:,.1f} -> {second:,.1f} {unit} (median, first and second half), {slope:+,.1f} {unit}/hour"
        ).replace("  ", " ")
        out.append((label, text, grows))
    return out


# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="producers and relays for a long time; does anything grow without bound?")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=1000.0, help="rows a second the producers insert")
    p.add_argument("--relays", type=int, default=2)
    p.add_argument("--aggregates", type=int, default=2000)
    p.add_argument("--kill-every", type=float, default=120.0, help="seconds between SIGKILLs of one relay")
    p.add_argument("--prune-older-than", default="5m")
    p.add_argument("--prune-interval", default="1m")
    p.add_argument("--tolerance", type=float, default=0.25)
    p.add_argument("--dsn", help="use this PostgreSQL instead of a cluster of the soak's own (autovacuum on)")
    p.add_argument("--amqp-url", default=os.environ.get("RELAY_TEST_AMQP_URL", DEFAULT_AMQP_URL))
    p.add_argument("--json", metavar="FILE", help="also write every sample to FILE")
    args = p.parse_args(argv)
    if args.dsn:
        return soak(args, args.dsn)
    if not shutil.which("pg_createcluster"):
        raise SystemExit("soak: pg_createcluster not found; pass --dsn to use an existing PostgreSQL")
    with own_cluster() as dsn:
        return soak(args, dsn)


def soak(args: argparse.Namespace, dsn: str) -> int:
    schema = f"soak_{uuid.uuid4().hex[:8]}"
    queue = f"soak-{uuid.uuid4().hex[:8]}"
    logs = Path(tempfile.mkdtemp(prefix="relay-soak-"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        autovacuum = conn.execute("SHOW autovacuum").fetchone()
    migrate = [
        *relay_bin(),
        "migrate",
        "--dsn",
        dsn,
        "--schema",
        schema,
        "--ordered",
        "Order*",
        "--unordered",
        "Email*",
    ]
    subprocess.run(migrate, check=True, capture_output=True)
    asyncio.run(declare_queue(args.amqp_url, queue))
    table = sql.Identifier(schema, "outbox")
    counters = Counters()
    stop = threading.Event()  # the producers'
    done = threading.Event()  # the consumer's, once the rest has arrived
    print(
        f"soak: {args.minutes:g} min at {args.rate:,.0f} rows/s, {args.relays} relays (one SIGKILLed every"
        f" {args.kill_every:g}s), prune older than {args.prune_older_than} every {args.prune_interval};"
        f" autovacuum {autovacuum[0] if autovacuum else '?'}; {os.cpu_count()} CPUs; logs in {logs}",
        flush=True,
    )
    relays = Relays(args, dsn, schema, queue, logs)
    threads = [
        threading.Thread(target=produce, args=(dsn, table, args.rate, args.aggregates, stop, counters), daemon=True),
        threading.Thread(target=consume, args=(args.amqp_url, queue, done, counters), daemon=True),
    ]
    for t in threads:
        t.start()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    next_kill = started + args.kill_every
    end = started + args.minutes * 60
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while time.monotonic() < end:
                time.sleep(max(0.0, started + (len(samples) + 1) * SAMPLE_S - time.monotonic()))
                relays.check_running()
                if time.monotonic() >= next_kill:
                    relays.kill_one()
                    next_kill += args.kill_every
                s = sample(conn, schema, relays, counters.take_lags())
                s["t"] = time.monotonic() - started
                samples.append(s)
                print(
                    f"{s['t']:6.0f}s lag p50 {s['lag_p50_ms']:7.1f} ms p99 {s['lag_p99_ms']:7.1f} ms | rss"
                    f" {s['relay_rss_mb']:5.1f} MB | outbox {s['outbox_heap_mb']:6.1f} MB + idx"
                    f" {s['outbox_index_mb']:6.1f} MB | heads {s['heads_mb']:5.2f} MB | commits"
                    f" {s['commits_mb']:5.2f} MB | dead tuples {s['outbox_dead_tuples']:8,.0f} /"
                    f" {s['heads_dead_tuples']:6,.0f} | autovacuums {s['autovacuum_runs']:3.0f} | not done"
                    f" {s['backlog']:6,.0f}",
                    flush=True,
                )
        stop.set()
        for t in threads[:1]:
            t.join()
        # Let the relays deliver what is left, then the consumer take it.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with counters.lock:
                if len(counters.seen) >= counters.produced:
                    break
            time.sleep(0.5)
    finally:
        stop.set()
        done.set()
        relays.stop()
        asyncio.run(delete_queue(args.amqp_url, queue))
    with psycopg.connect(dsn, autocommit=True) as conn:
        dead_row = conn.execute(sql.SQL("SELECT count(*) FROM {} WHERE status = 'dead'").format(table)).fetchone()
    dead = int(dead_row[0]) if dead_row else 0
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=1))
    # The table reaches its retained size once rows older than the prune window go, at the
    # next prune after that: the warm-up covers both, and a third of the run at least.
    retained = (
        parse_duration(args.prune_older_than).total_seconds() + 2 * parse_duration(args.prune_interval).total_seconds()
    )
    warmup = max(args.minutes * 60 / 3, retained)
    print(
        f"\nproduced {counters.produced:,}, received {counters.received:,} ({len(counters.seen):,} distinct ids),"
        f" dead {dead}, relays killed {relays.kills}; growth after the first {warmup / 60:.0f} min"
        f" (a metric grows without bound when its second half's median is more than {args.tolerance:.0%} above"
        f" its first half's, or above its noise floor, and its slope is positive):"
    )
    failed = False
    for label, text, grows in verdicts(samples, warmup, args.tolerance, noise_floors(args.rate)):
        failed |= grows
        print(f"  {'GROWS' if grows else 'bounded':8} {label}: {text}")
    lost = counters.produced - len(counters.seen)
    if lost or dead:
        print(f"FAIL: {lost} produced rows never reached the consumer, {dead} dead")
        failed = True
    print("FAIL: something grows without bound" if failed else "PASS: everything levelled off")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
