"""SQS leg benchmark: the relay end to end versus plain boto3 SendMessageBatch, same server, same run.

    .venv/bin/python scripts/bench_sqs.py                    # 20,000 messages, standard queue
    .venv/bin/python scripts/bench_sqs.py --fifo --messages 10000
    .venv/bin/python scripts/bench_sqs.py --ordered          # every event ordered per aggregate

Both sides send the same messages (the same bodies and the same six message attributes,
built by the adapter's own ``prepare``) to the same embedded SQS, each into a fresh queue:

- raw: boto3 ``send_message_batch`` with 10 entries per call from a thread pool, one shared
  client with boto3's defaults, at 8, 16, 32 threads and the relay's own thread count;
  in each round the fastest counts. The goal is measured against this;
- raw, tuned: the same, with the client settings the adapter uses (no client-side
  parameter validation), to show how much of the result is the client configuration;
- relay: ``relay start --broker sqs`` as a subprocess draining an outbox pre-filled with those
  messages, timed from its "relay started" log line to the last row's ``done_at``
  (PostgreSQL claim, publish, fenced finalize: the whole path);
- relay, routed: the same outbox with one route sending half the event types to a second
  queue (two publishers, two clients), in every round: the cost of routing beside one queue;
- relay, unpipelined (``--compare-unpipelined``): the same with ``--no-pipeline``, right
  after it in the same round, so the two dispatch loops are compared under the same load.
- baseline relay (``--baseline-relay PATH``): another checkout's ``relay`` executable (say,
  the branch's base in a venv of its own), also in every round: before and after a change
  under the same load.

Raw and relay alternate for ``--rounds`` rounds and the medians are compared. A round in
which any run saw CPU spent by other work on the machine is marked disturbed, and left
out of the medians when undisturbed rounds exist. Each line also says
where the CPU went: the sending process, the SQS process, PostgreSQL, and the rest of
the machine (anyone else's work).

The embedded SQS is moto's ThreadedMotoServer in a process of its own (so neither side
shares its interpreter), with two changes that keep its cost per message from growing
with the queue: the same clock read faster, and the approximate message counters (which
moto recomputes by scanning the whole queue on every send) answered from the number of
stored messages, exact here since nothing is received. Both make the server faster,
which makes the comparison harder for the relay, not easier.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import psycopg
from botocore.config import Config
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.adapters.aws.entries import Entry
from relay.adapters.aws.settings import concurrency_for
from relay.adapters.sqs.entries import prepare
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.message import OutboxMessage
from relay.ordering import OrderingMap
from scripts.procstat import command_cpu, machine_busy, process_cpu

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_sqs"
REGION = "us-east-1"
# A round counts as undisturbed when no run in it saw more than this much CPU spent by work
# that was not its own (the machine may be shared).
FOREIGN_CPU_LIMIT_S = 0.5
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
}


# ---------------------------------------------------------------------------------------
# The embedded SQS, in its own process


def _serve(conn: Any) -> None:
    import logging
    import threading

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    import moto.sqs.models
    from moto.server import ThreadedMotoServer

    models: Any = moto.sqs.models
    slow_seconds, slow_millis = models.unix_time, models.unix_time_millis
    models.unix_time = lambda dt=None: time.time() if dt is None else slow_seconds(dt)
    models.unix_time_millis = lambda dt=None: time.time() * 1000.0 if dt is None else slow_millis(dt)
    # Nothing is ever received, in flight or delayed here, so "every stored message" is the
    # exact count, and costs nothing instead of a scan of the queue on every send.
    models.Queue.approximate_number_of_messages = property(lambda self: len(self._messages))
    models.Queue.approximate_number_of_messages_delayed = property(lambda self: 0)
    models.Queue.approximate_number_of_messages_not_visible = property(lambda self: 0)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port()[1])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop()


class EmbeddedSqs:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        self.endpoint = f"http://127.0.0.1:{parent.recv()}"
        assert self.process.pid is not None
        self.pid: int = self.process.pid

    def stop(self) -> None:
        if self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGTERM)
        self.process.join(5)


# ---------------------------------------------------------------------------------------
# The messages


# The event types the routed run sends to its second queue (half of make_events' kinds).
ROUTED_TYPES = ("OrderPaid", "OrderShipped")


def make_events(n: int, aggregates: int, payload_bytes: int, seed: int = 7) -> list[tuple[str, str, dict[str, Any]]]:
    rng = random.Random(seed)
    kinds = ("OrderCreated", "OrderItemAdded", "OrderPaid", "OrderShipped")
    events = []
    for i in range(n):
        agg = f"ord-{i % aggregates:06d}"
        payload = {
            "order_id": agg,
            "seq": i // aggregates,
            "customer_id": f"cus-{rng.randrange(10**5)}",
            "amount_cents": rng.randrange(100, 100_000),
            "note": "",
        }
        pad = payload_bytes - len(json.dumps(payload))
        payload["note"] = "x" * max(pad, 0)
        events.append((agg, kinds[(i // aggregates) % len(kinds)], payload))
    return events


def entries_for(events: list[tuple[str, str, dict[str, Any]]], fifo: bool) -> list[Any]:
    """The request entries the relay would send for these events (attempt 1, first lease)."""
    out = []
    for i, (agg, event_type, payload) in enumerate(events, start=1):
        m = OutboxMessage(
            id=i,
            aggregate_type="order",
            aggregate_id=agg,
            event_type=event_type,
            body=json.dumps(payload).encode(),
            attempt=1,
            lease_version=1,
            ordered=False,
        )
        entry = prepare(m, fifo=fifo, max_bytes=1_048_576)
        assert isinstance(entry, Entry)
        out.append(entry.request)
    return out


def new_queue(client: Any, fifo: bool, label: str) -> str:
    name = f"bench-{label}-{int(time.time() * 1000) % 10**9}" + (".fifo" if fifo else "")
    attrs = {"FifoQueue": "true"} if fifo else {}
    url: str = client.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"]
    return url


def count_in_queue(endpoint: str, url: str) -> int:
    client = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    attrs = client.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attrs["Attributes"]["ApproximateNumberOfMessages"])


@dataclass
class Run:
    """One timed run: its wall time and where the machine's CPU went meanwhile."""

    seconds: float
    client_cpu: float  # the sending process: the bench's threads, or the relay
    sqs_cpu: float  # the embedded SQS process
    postgres_cpu: float  # every PostgreSQL process
    machine_cpu: float  # all cores, all processes (including anyone else's work)

    def rate(self, n: int) -> float:
        return n / self.seconds

    def foreign_cpu(self, *, uses_postgres: bool) -> float:
        """CPU seconds of work that was not this run's: anything outside the three processes
        (and, for a raw run, any PostgreSQL activity at all, including backends exiting)."""
        rest = self.machine_cpu - self.client_cpu - self.sqs_cpu - self.postgres_cpu
        return max(rest, 0.0) + (0.0 if uses_postgres else abs(self.postgres_cpu))

    def cpu_note(self) -> str:
        rest = self.machine_cpu - self.client_cpu - self.sqs_cpu - self.postgres_cpu
        return (
            f"cpu s: sender {self.client_cpu:4.1f}  sqs {self.sqs_cpu:4.1f}"
            f"  postgres {self.postgres_cpu:4.1f}  other {max(rest, 0.0):4.1f}"
        )


# ---------------------------------------------------------------------------------------
# Raw boto3


def raw_run(endpoint: str, entries: list[Any], fifo: bool, threads: int, sqs_pid: int, *, tuned: bool = False) -> Run:
    """Send every entry with SendMessageBatch from ``threads`` threads: with boto3's defaults,
    or (``tuned``) with the client settings the relay's adapter uses."""
    config = Config(max_pool_connections=threads, retries={"total_max_attempts": 2, "mode": "standard"})
    if tuned:
        config = config.merge(Config(parameter_validation=False, tcp_keepalive=True))
    client = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION, config=config)
    url = new_queue(client, fifo, f"raw{threads}")
    chunks = [entries[i : i + 10] for i in range(0, len(entries), 10)]

    def send(chunk: list[Any]) -> int:
        answer = client.send_message_batch(QueueUrl=url, Entries=chunk)
        if answer.get("Failed"):
            raise RuntimeError(f"raw send failed: {answer['Failed'][:1]}")
        return len(answer["Successful"])

    start, cpu0, sqs0 = time.perf_counter(), time.process_time(), process_cpu(sqs_pid)
    pg0, busy0 = command_cpu("postgres"), machine_busy()[0]
    with ThreadPoolExecutor(threads) as pool:
        sent = sum(pool.map(send, chunks))
    run = Run(
        time.perf_counter() - start,
        time.process_time() - cpu0,
        process_cpu(sqs_pid) - sqs0,
        command_cpu("postgres") - pg0,
        machine_busy()[0] - busy0,
    )
    assert sent == len(entries)
    assert count_in_queue(endpoint, url) == len(entries)
    return run


# ---------------------------------------------------------------------------------------
# The relay


def seed_outbox(dsn: str, events: list[tuple[str, str, dict[str, Any]]], ordering: OrderingMap) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    subprocess.run([*relay_bin(), "migrate", "--dsn", dsn, "--schema", SCHEMA], check=True, capture_output=True)
    asyncio.run(_store_ordering(dsn, ordering))
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        table = sql.Identifier(SCHEMA, "outbox")
        copy = sql.SQL("COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN").format(table)
        with cur.copy(copy) as c:
            for agg, event_type, payload in events:
                c.write_row(("order", agg, event_type, json.dumps(payload)))
        conn.execute(sql.SQL("ANALYZE {}").format(table))


async def _store_ordering(dsn: str, ordering: OrderingMap) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await store_ordering(conn, OutboxNames(schema=SCHEMA, table="outbox"), ordering)


def relay_bin() -> list[str]:
    script = Path(sys.executable).with_name("relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


def relay_run(
    args: argparse.Namespace,
    endpoint: str,
    n: int,
    ordering: OrderingMap,
    sqs_pid: int,
    extra: tuple[str, ...] = (),
    binary: tuple[str, ...] = (),
    *,
    routed: bool = False,
) -> Run:
    """``relay start`` draining the pre-filled outbox, timed from its "relay started" log
    line to the last ``done_at`` PostgreSQL recorded (same host clock); checks that every
    row is done and that the queue holds every message.

    Completion is polled every 100 ms through the partial indexes on pending and
    processing rows, so the polling costs PostgreSQL next to nothing; the precise end comes
    from ``done_at``, not from the poll.

    ``routed``: a route sends half the event types (OrderPaid, OrderShipped) to a second
    queue, the rest to ``--queue-url``; both queues together must hold every message.
    """
    client = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    url = new_queue(client, args.fifo, "relay")
    urls = [url]
    if routed:
        urls.append(new_queue(client, args.fifo, "routed"))
        extra = (*extra, "--route", f"{','.join(ROUTED_TYPES)}={urls[1]}")
    order_flags = ["--ordering-default", "ordered" if ordering.default_ordered else "unordered"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")} | FAKE_AWS
    log_path = Path(tempfile.gettempdir()) / "relay-bench-sqs.log"
    command = [
        *(binary or relay_bin()), "start", "--dsn", args.dsn, "--schema", SCHEMA,
        "--broker", "sqs", "--queue-url", url, "--endpoint-url", endpoint, "--region", REGION,
        "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--log-level", "info",
        *order_flags, *extra,
    ]  # fmt: skip
    table = sql.Identifier(SCHEMA, "outbox")
    busy = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending')"
        " OR EXISTS (SELECT 1 FROM {t} WHERE status = 'processing')"
    ).format(t=table)
    with log_path.open("w") as log, psycopg.connect(args.dsn, autocommit=True) as conn:
        relay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            while (started := _started_at(log_path)) is None:
                if relay.poll() is not None:
                    raise SystemExit(f"relay exited: {log_path.read_text()[-2000:]}")
                time.sleep(0.01)
            cpu0, sqs0, pg0, busy0 = (
                process_cpu(relay.pid),
                process_cpu(sqs_pid),
                command_cpu("postgres"),
                machine_busy()[0],
            )
            while conn.execute(busy).fetchone()[0]:  # type: ignore[index]
                if relay.poll() is not None:
                    raise SystemExit(f"relay exited: {log_path.read_text()[-2000:]}")
                time.sleep(0.1)
            cpu = (
                process_cpu(relay.pid) - cpu0,
                process_cpu(sqs_pid) - sqs0,
                command_cpu("postgres") - pg0,
                machine_busy()[0] - busy0,
            )
        finally:
            relay.send_signal(signal.SIGTERM)
            code = relay.wait(30)
        row = conn.execute(
            sql.SQL("SELECT count(*) FILTER (WHERE status = 'done'), max(done_at) FROM {}").format(table)
        ).fetchone()
    assert row is not None
    done, last_done = row
    if done != n or code != 0:
        raise SystemExit(f"relay run not clean: {done} of {n} done, exit code {code}; see {log_path}")
    in_queues = [count_in_queue(endpoint, u) for u in urls]
    if sum(in_queues) != n or 0 in in_queues:
        raise SystemExit(f"the relay's queues hold {in_queues} messages, expected {n} in all, some in each")
    return Run((last_done - started).total_seconds(), *cpu)


def _started_at(log_path: Path) -> datetime | None:
    for line in log_path.read_text().splitlines():
        if "relay started" in line:
            return datetime.strptime(line.split(" ", 1)[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    return None


# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="relay end to end vs raw boto3 SendMessageBatch, embedded SQS")
    p.add_argument("--dsn", default=os.environ.get("RELAY_DSN", DEFAULT_DSN))
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--aggregates", type=int, default=1_000)
    p.add_argument("--payload-bytes", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3, help="raw then relay, this many times (medians are compared)")
    p.add_argument("--fifo", action="store_true", help="a FIFO queue (default: standard)")
    p.add_argument("--ordered", action="store_true", help="route every event through the ordered claim")
    p.add_argument(
        "--compare-unpipelined", action="store_true", help="also run the relay with --no-pipeline in every round"
    )
    p.add_argument(
        "--baseline-relay",
        metavar="PATH",
        help="also run this `relay` executable (another checkout's, say) in every round, same outbox and queue",
    )
    args = p.parse_args(argv)
    os.environ.update(FAKE_AWS)
    n = args.messages

    ordering = OrderingMap(default_ordered=args.ordered)
    events = make_events(n, args.aggregates, args.payload_bytes)
    entries = entries_for(events, args.fifo)
    relay_threads = concurrency_for(args.workers, args.batch_size)
    print(
        f"{n} messages of ~{args.payload_bytes} B over {args.aggregates} aggregates,"
        f" {'FIFO' if args.fifo else 'standard'} queue, {'ordered' if args.ordered else 'unordered'} events;"
        f" relay: {args.workers} workers x batch {args.batch_size} ({relay_threads} SQS threads);"
        f" {platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs,"
        f" load average {os.getloadavg()[0]:.2f} at start"
    )
    sqs = EmbeddedSqs()
    sqs_pid = sqs.pid
    pools = sorted({8, 16, 32, relay_threads})
    raws: list[Run] = []
    tuned: list[Run] = []
    relays: list[Run] = []
    routed: list[Run] = []
    unpipelined: list[Run] = []
    baseline: list[Run] = []
    clean: list[int] = []  # rounds no other work disturbed
    try:
        for r in range(1, args.rounds + 1):
            # The strictest baseline: raw at every pool size, the fastest counts.
            by_pool = {t: raw_run(sqs.endpoint, entries, args.fifo, t, sqs_pid) for t in pools}
            best = max(pools, key=lambda t: by_pool[t].rate(n))
            raws.append(by_pool[best])
            tuned.append(raw_run(sqs.endpoint, entries, args.fifo, best, sqs_pid, tuned=True))
            seed_outbox(args.dsn, events, ordering)
            relays.append(relay_run(args, sqs.endpoint, n, ordering, sqs_pid))
            seed_outbox(args.dsn, events, ordering)
            routed.append(relay_run(args, sqs.endpoint, n, ordering, sqs_pid, routed=True))
            if args.compare_unpipelined:
                seed_outbox(args.dsn, events, ordering)
                unpipelined.append(relay_run(args, sqs.endpoint, n, ordering, sqs_pid, ("--no-pipeline",)))
            if args.baseline_relay:
                seed_outbox(args.dsn, events, ordering)
                baseline.append(relay_run(args, sqs.endpoint, n, ordering, sqs_pid, (), (args.baseline_relay,)))
            raw, t, relay = raws[-1], tuned[-1], relays[-1]
            print(f"round {r}: raw by pool size: " + ", ".join(f"{k} thr {v.rate(n):.0f}" for k, v in by_pool.items()))
            print(f"         raw ({best:2d} thr)  {raw.rate(n):6.0f} msg/s  {raw.seconds:6.2f}s  {raw.cpu_note()}")
            print(f"         raw, tuned    {t.rate(n):6.0f} msg/s  {t.seconds:6.2f}s  {t.cpu_note()}")
            foreign = max(
                *(v.foreign_cpu(uses_postgres=False) for v in (*by_pool.values(), t)),
                relay.foreign_cpu(uses_postgres=True),
            )
            if foreign < FOREIGN_CPU_LIMIT_S:
                clean.append(r - 1)
            print(
                f"         relay         {relay.rate(n):6.0f} msg/s  {relay.seconds:6.2f}s  {relay.cpu_note()}"
                f"   ratio {relay.rate(n) / raw.rate(n):.2f}"
                + ("" if foreign < FOREIGN_CPU_LIMIT_S else f"   (disturbed: {foreign:.1f} cpu s of other work)")
            )
            for label, runs in (("routed, 2 q  ", routed), ("--no-pipeline", unpipelined), ("baseline     ", baseline)):
                if runs:
                    u = runs[-1]
                    print(
                        f"         {label} {u.rate(n):6.0f} msg/s  {u.seconds:6.2f}s  {u.cpu_note()}"
                        f"   ratio {u.rate(n) / raw.rate(n):.2f}"
                    )
    finally:
        sqs.stop()
    rounds = clean or list(range(len(relays)))
    if clean:
        print(f"{len(clean)} of {len(relays)} rounds undisturbed by other work; medians over those")
    else:
        print(f"every round was disturbed by other work on the machine: medians over all {len(relays)}, unreliable")
    raw_rate = statistics.median(raws[i].rate(n) for i in rounds)
    tuned_rate = statistics.median(tuned[i].rate(n) for i in rounds)
    relay_rate = statistics.median(relays[i].rate(n) for i in rounds)
    print(
        f"median: relay {relay_rate:.0f} msg/s vs raw boto3 {raw_rate:.0f} msg/s (best pool size of each round):"
        f" ratio {relay_rate / raw_rate:.2f} (goal 0.90)"
    )
    print(
        f"        vs raw boto3 with the adapter's client settings {tuned_rate:.0f} msg/s:"
        f" ratio {relay_rate / tuned_rate:.2f}; load average {os.getloadavg()[0]:.2f} at the end"
    )
    routed_rate = statistics.median(routed[i].rate(n) for i in rounds)
    print(
        f"        relay routed to two queues {routed_rate:.0f} msg/s beside one queue {relay_rate:.0f} msg/s:"
        f" ratio {routed_rate / relay_rate:.2f}"
    )
    for label, runs in (("relay --no-pipeline", unpipelined), ("baseline relay", baseline)):
        if runs:
            other_rate = statistics.median(runs[i].rate(n) for i in rounds)
            print(f"        {label} {other_rate:.0f} msg/s: ratio {other_rate / raw_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
