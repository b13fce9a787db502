"""The HTTP destination's throughput: `relay start --broker http` into a local receiver
against a raw aiohttp client posting the same messages at the same concurrency, in the
same run, as a ratio; and the CPU each spends per message.

The receiver is a bare aiohttp server in its own process answering 200 to everything (it
records nothing, so it is never the bottleneck it would be with a database behind it). The
relay's rate counts from the receiver's first request to its N-th, so the process's
start-up is left out; its CPU is the relay process's user+system time over the same span
(the earlier figures in BENCHMARKS.md counted its whole run, start-up included).

    python scripts/bench_http.py [--messages 20000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import aiohttp
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.db.names import OutboxNames
from relay.db.statements import schema_sql
from scripts import progress
from scripts.procstat import CpuMeter, process_cpu

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_http"
PAYLOAD = json.dumps({"order_id": 42, "amount": "19.90", "currency": "EUR", "note": "x" * 200})
# BENCH_RELAY: another `relay` executable (a checkout before a change, say) for every relay leg.
RELAY = os.environ.get("BENCH_RELAY") or str(Path(sys.executable).with_name("relay"))

RECEIVER = textwrap.dedent(
    """
    import sys
    from aiohttp import web
    count = 0
    async def hook(request):
        global count
        await request.read()
        count += 1
        return web.Response(text="ok")
    async def seen(request):
        return web.Response(text=str(count))
    app = web.Application()
    app.router.add_post("/hook", hook)
    app.router.add_get("/count", seen)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
    """
)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def count(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=5) as r:
        return int(r.read())


def setup(dsn: str, messages: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        conn.execute(OutboxNames(SCHEMA).render(schema_sql()))
    # The plain SKIP LOCKED path, like the raw client's unordered posts.
    subprocess.run(
        [RELAY, "settings", "set", "--dsn", dsn, "--schema", SCHEMA, "--ordering-default", "unordered"],
        check=True, capture_output=True,
    )  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'order', 'order-' || (g %% 1000), 'OrderPaid', %s::jsonb FROM generate_series(1, %s) AS g"
            ).format(sql.Identifier(SCHEMA, "outbox")),
            (PAYLOAD, messages),
        )
        conn.execute("CHECKPOINT")


def relay_run(dsn: str, port: int, messages: int, concurrency: int) -> Result:
    """Messages per second and CPU seconds per message of one relay process draining the outbox."""
    before = count(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DSN=dsn, RELAY_LOG_LEVEL="warning")
    proc = subprocess.Popen(
        [RELAY, "start", "--schema", SCHEMA, "--broker", "http", "--url", f"http://127.0.0.1:{port}/hook",
         "--workers", "4", "--batch-size", "100", "--http-concurrency", str(concurrency),
         "--poll-interval", "50ms"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        return timed(proc.pid, messages, lambda: count(port) > before, lambda: count(port) >= before + messages, 0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def raw_run(port: int, messages: int, concurrency: int) -> Result:
    """The same messages posted by a bare aiohttp client, ``concurrency`` at a time."""
    url = f"http://127.0.0.1:{port}/hook"
    body = PAYLOAD.encode()
    slots = asyncio.Semaphore(concurrency)
    span = Span(os.getpid())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def post(i: int) -> None:
            async with slots:
                headers = {"Content-Type": "application/json", "Idempotency-Key": str(uuid.uuid4()),
                           "Relay-Outbox-Id": str(i), "Relay-Event-Type": "OrderPaid"}  # fmt: skip
                async with session.post(url, data=body, headers=headers) as response:
                    await response.read()
                    assert response.status == 200

        started = time.perf_counter()
        await asyncio.gather(*(post(i) for i in range(messages)))
        elapsed = time.perf_counter() - started
    return span.result(messages, elapsed)


class Result(NamedTuple):
    """One leg's run: messages per second, and CPU seconds per message of the sender (the
    relay process, or this one for a raw client), of PostgreSQL's processes and of the
    destination's server (the receiver, nats-server, the Kafka broker) over the timed span."""

    rate: float
    cpu: float
    pg: float = 0.0
    server: float = 0.0


# The destination server's processes for Span (set by each script's main): by pid.
SERVER_PIDS: list[int] = []


class Span:
    """The CPU a timed span costs the sender (``pid``), PostgreSQL and the destination's server."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pg = CpuMeter("postgres").start()
        self.started = (process_cpu(pid), sum(process_cpu(p) for p in SERVER_PIDS))

    def result(self, messages: int, elapsed: float) -> Result:
        sender = process_cpu(self.pid) - self.started[0]
        server = sum(process_cpu(p) for p in SERVER_PIDS) - self.started[1]
        return Result(messages / elapsed, sender / messages, self.pg.stop() / messages, server / messages)


def timed(pid: int, messages: int, moving: Callable[[], bool], done: Callable[[], bool], every: float) -> Result:
    """A relay leg's figures: the clock starts when ``moving`` first says so (the relay's
    start-up is left out) and stops when ``done`` does, polled every ``every`` seconds;
    the CPU is the span's (:class:`Span`) for the relay process ``pid``."""
    while not moving():
        time.sleep(0.002)
    started = time.perf_counter()
    span = Span(pid)
    while not done():
        time.sleep(every)
    return span.result(messages, time.perf_counter() - started)


def log_run(dsn: str, messages: int) -> Result:
    """The relay's own pace on the same outbox, rows and settings (4 workers, batches of
    100), with the ``log`` destination, its output discarded: what a destination's leg
    is held against (issue 40: >= 0.8x of it, or >= 0.9x of the raw client where that is
    slower). Timed from the first claim to the last finalize, polled with index probes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DSN=dsn, RELAY_LOG_LEVEL="warning")
    table = sql.Identifier(SCHEMA, "outbox")
    moving, waiting = progress.moving(table), progress.waiting(table)
    proc = subprocess.Popen(
        [RELAY, "start", "--schema", SCHEMA, "--broker", "log", "--workers", "4", "--batch-size", "100",
         "--poll-interval", "50ms"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:

            def holds(query: sql.Composed) -> bool:
                row = conn.execute(query).fetchone()
                return bool(row and row[0])

            return timed(proc.pid, messages, lambda: holds(moving), lambda: not holds(waiting), 0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def alternate(rounds: int, legs: dict[str, Callable[[], Result]]) -> dict[str, list[Result]]:
    """``rounds`` rounds of every leg, the order turning by one each round (the machine
    warms up and the database grows as a run goes on)."""
    results: dict[str, list[Result]] = {name: [] for name in legs}
    names = list(legs)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            results[name].append(legs[name]())
    return results


def report(title: str, labels: dict[str, str], results: dict[str, list[Result]]) -> None:
    """The medians as a table (rate, and CPU a message by process), the relay's rate
    against the raw client's and against its own ``log`` pace (when measured), the goal's
    verdict, and each round's rates."""

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in results[name])

    rate = {name: median(name, "rate") for name in results}
    cpu = {name: median(name, "cpu") * 1e6 for name in results}
    print(title)
    print("| sender | messages/s | sender CPU a message | PostgreSQL | destination server |\n|---|---|---|---|---|")
    for name, label in labels.items():
        print(
            f"| {label} | {rate[name]:,.0f} | {cpu[name]:,.0f} µs | {median(name, 'pg') * 1e6:,.0f} µs"
            f" | {median(name, 'server') * 1e6:,.0f} µs |"
        )
    print(f"ratio relay/raw: {rate['relay'] / rate['raw']:.2f}x; CPU {cpu['relay'] / cpu['raw']:.2f}x the raw client's")
    if "log" in rate:
        of_log, of_raw = rate["relay"] / rate["log"], rate["relay"] / rate["raw"]
        met = of_log >= 0.8 or (rate["raw"] < rate["log"] and of_raw >= 0.9)
        print(
            f"ratio relay/log: {of_log:.2f}x (goal: >= 0.8x the relay's own log pace, or >= 0.9x the raw client"
            f" where it is slower: {'met' if met else 'MISSED'})"
        )
    print("rounds:", {k: [f"{r.rate:,.0f}/s" for r in v] for k, v in results.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.rounds = 3000, 1
    port = free_port()
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port)])
    SERVER_PIDS[:] = [receiver.pid]
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                count(port)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

        def relay() -> Result:
            setup(args.dsn, args.messages)
            return relay_run(args.dsn, port, args.messages, args.concurrency)

        def log() -> Result:
            setup(args.dsn, args.messages)
            return log_run(args.dsn, args.messages)

        raw = lambda: asyncio.run(raw_run(port, args.messages, args.concurrency))  # noqa: E731
        results = alternate(args.rounds, {"relay": relay, "raw": raw, "log": log})
    finally:
        receiver.terminate()
        receiver.wait()
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    title = f"HTTP: {args.messages:,} messages, concurrency {args.concurrency}, median of {args.rounds} rounds"
    labels = {"raw": "raw aiohttp client", "relay": "relay start --broker http", "log": "relay start --broker log"}
    report(title, labels, results)


if __name__ == "__main__":
    main()
