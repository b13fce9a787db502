"""Scale-out: 1, 2 and 4 `relay start --workers 2` processes over one outbox, same run.

    .venv/bin/python scripts/bench_scale.py                 # both legs, 2 rounds: a few minutes
    .venv/bin/python scripts/bench_scale.py --quick         # a smoke run
    .venv/bin/python scripts/bench_scale.py --leg db --rounds 3 --markdown

Two legs, each over a fresh outbox per run:

- db: ``--broker log`` with its output to /dev/null. It writes one JSON line per message
  and confirms it; the script measures what that costs alone (in this process, same
  messages) and prints it beside the relay's CPU, so the figure is the relay and
  PostgreSQL with a broker that costs almost nothing.
- rabbitmq: ``--broker rabbitmq`` with publisher confirms (as the relay always publishes)
  into a durable queue behind a direct exchange, purged before each run.

How one run goes: a fresh schema (migrated; event types OrderPlaced, OrderPaid,
OrderShipped and OrderDelivered ordered, OrderNotified unordered; wake-ups on). The
backlog (80% ordered over 2,000 aggregates, 20% unordered) is written first, one event
per producer transaction (``--per-transaction``), as producers write it. Then this
script locks the outbox table (EXCLUSIVE: reads pass, writes wait), starts N relay
processes and waits until every worker's first claim is blocked on that lock; it commits,
and every worker starts at once. The clock runs from that commit to the last finalize
(``max(done_at)``, database clock), so no process's start-up is counted and none starts
ahead of the others.

While the backlog drains, a sampler reads ``pg_stat_activity`` every 100 ms for the relays'
own sessions (found by their TCP client ports, so other users of the cluster are not
counted) and sorts each busy session into on CPU, a wait event, or idle in transaction
(waiting for the relay between two statements of a claim); it also names the statement.
CPU time (utime + stime from /proc) is summed per group over the run: the relay
processes, their PostgreSQL backends, PostgreSQL's background processes (WAL writer,
checkpointer, background writer, postmaster), RabbitMQ, and the rest of the machine
("not ours": other users' sessions and programs, and this script's own probes), so the
table says where the time goes as processes are added.

Rounds alternate the order of the process counts (1, 2, 4 then 4, 2, 1); rates are
medians over the rounds, and "vs 1" the median of each round's ratio to that round's
1-process run. A run whose relays log a warning (on a shared cluster, another suite may
kill every 'outbox-relay' session) is run again, up to twice, and flagged if it stays
disturbed. The schema, exchange and queue are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.exceptions
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.adapters.log import LogPublisher
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.db.statements import named_queries
from relay.message import OutboxMessage
from relay.ordering import OrderingMap
from scripts.procstat import machine_busy, pids_named, process_cpu

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
SCHEMA = "bench_scale"
ORDERED_TYPES = ("OrderPlaced", "OrderPaid", "OrderShipped", "OrderDelivered")
UNORDERED_TYPE = "OrderNotified"
# Every fifth event is the unordered type: 80% ordered, as in bench_rabbitmq.py.
EVENT_TYPES = (*ORDERED_TYPES, UNORDERED_TYPE)
ORDERING = OrderingMap(default_ordered=True, unordered=(UNORDERED_TYPE,))
SAMPLE_S = 0.1  # pg_stat_activity every 100 ms: a few hundred samples per run
GROUPS = ("relay", "pg backends", "pg background", "rabbitmq", "not ours")

Event = tuple[str, str, str]  # aggregate_id, event_type, payload JSON


def make_events(n: int, aggregates: int, payload_bytes: int, seed: int = 11) -> list[Event]:
    rnd = random.Random(seed)
    filler = "x" * max(0, payload_bytes - 60)
    return [
        (
            f"order-{rnd.randrange(aggregates)}",
            EVENT_TYPES[i % len(EVENT_TYPES)],
            json.dumps({"seq": i, "note": filler}),
        )
        for i in range(n)
    ]


# -- CPU accounting from /proc --------------------------------------------------------


_CLIENT_BACKEND = re.compile(r"postgres: [^:]+: \S+ \S+ (\[local\]|\S+\(\d+\))")


def pg_background(pids: Sequence[int]) -> list[int]:
    """The PostgreSQL processes that serve no session (postmaster, WAL writer,
    checkpointer, background writer...): every session's backend shows its user,
    database and client in its process title."""
    out = []
    for pid in pids:
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if not _CLIENT_BACKEND.match(title):
            out.append(pid)
    return out


def client_ports(pid: int) -> set[int]:
    """Local TCP ports of one process's sockets: its PostgreSQL sessions' client_port."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except FileNotFoundError:
        return set()
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


@dataclass
class CpuSnapshot:
    per_pid: dict[int, float]
    machine: float
    wall: float


def snapshot(pids: Sequence[int]) -> CpuSnapshot:
    return CpuSnapshot({p: process_cpu(p) for p in pids}, machine_busy()[0], time.perf_counter())


# -- pg_stat_activity sampling --------------------------------------------------------


def statement_patterns(names: OutboxNames, conn: psycopg.Connection[Any]) -> list[tuple[str, re.Pattern[str]]]:
    """Each relay statement as psycopg sends it ($1 for each parameter), as a prefix regex:
    pg_stat_activity truncates long statements, so only the first 300 characters count."""
    out = []
    for name, text in named_queries().items():
        rendered = names.render(text).as_string(conn).strip()
        parts = re.split(r"%\(\w+\)s", rendered)
        pattern, size = "", 0
        for i, part in enumerate(parts):
            literal = part.replace("%%", "%")
            pattern += re.escape(literal[: max(0, 300 - size)])
            size += len(literal)
            if size >= 300:
                break
            if i < len(parts) - 1:
                pattern += r"\$\d+"
        out.append((name, re.compile(pattern)))
    return out


class Sampler(threading.Thread):
    """Samples the relays' sessions in pg_stat_activity every SAMPLE_S until stopped."""

    def __init__(self, dsn: str, backend_pids: list[int], names: OutboxNames) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.backend_pids = backend_pids
        self.names = names
        self.patterns: list[tuple[str, re.Pattern[str]]] = []
        self.known: dict[str, str] = {}
        self.states: Counter[str] = Counter()
        self.statements: Counter[str] = Counter()
        self.locks: Counter[str] = Counter()  # heavyweight lock waits by statement
        self.samples = 0
        self.stop = threading.Event()

    def statement(self, query: str) -> str:
        name = self.known.get(query)
        if name is None:
            stripped = query.strip()
            name = (
                next((n for n, p in self.patterns if p.match(stripped)), None) or (stripped.split() or ["?"])[0].upper()
            )
            self.known[query] = name
        return name

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True, application_name="bench-scale-sampler") as conn:
            self.patterns = statement_patterns(self.names, conn)
            while not self.stop.is_set():
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event, query FROM pg_stat_activity"
                    " WHERE pid = ANY(%s) AND application_name = 'outbox-relay'",
                    (self.backend_pids,),
                ).fetchall()
                self.samples += 1
                for state, wtype, wevent, query in rows:
                    if state == "idle":
                        self.states["idle"] += 1
                        continue
                    if state == "idle in transaction":
                        kind = "idle in transaction"
                    elif wevent is None:
                        kind = "on CPU"
                    else:
                        kind = f"{wtype}:{wevent}"
                    self.states[kind] += 1
                    if state == "active":  # idle in transaction shows the statement before the pause
                        name = self.statement(query or "")
                        self.statements[name] += 1
                        if wtype == "Lock":
                            self.locks[f"{wevent} in {name}"] += 1
                time.sleep(SAMPLE_S)


# -- one run --------------------------------------------------------------------------


@dataclass
class Result:
    round: int
    leg: str
    processes: int
    rate: float
    seconds: float
    cpu: dict[str, float]  # CPU seconds per group over the run
    machine_cores: float  # average cores busy on the whole machine
    states: Counter[str]
    statements: Counter[str]
    locks: Counter[str]
    samples: int
    sessions: int
    ingest_s: float | None
    disturbed: str | None  # the relays' first warning, if they logged any (a session killed by others...)
    load: tuple[float, float, float] = field(default_factory=lambda: os.getloadavg())


def relay_bin() -> list[str]:
    script = Path(sys.executable).with_name("relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


def fetch(conn: psycopg.Connection[Any], query: sql.Composable, params: Any = None) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return tuple(row)


def reset_outbox(dsn: str, names: OutboxNames) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(names.schema)))

    async def prepare() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            await migrate(aconn, names)
            await store_ordering(aconn, names, ORDERING)  # wake-ups on, the default

    asyncio.run(prepare())


def wait_blocked(dsn: str, procs: list[subprocess.Popen[bytes]], workers: int, logs: list[Path]) -> list[int]:
    """Wait until every worker of every relay process is blocked on the gate (the outbox
    table lock this script holds); returns the PostgreSQL backend pids of all their
    sessions, found by the processes' TCP client ports."""
    deadline = time.monotonic() + 60
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            for proc, log in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    raise SystemExit(f"relay exited early: {log.read_text()[-2000:]}")
            ports = {p.pid: client_ports(p.pid) for p in procs}
            rows = conn.execute(
                "SELECT pid, client_port, application_name = 'outbox-relay' AND wait_event_type = 'Lock'"
                " FROM pg_stat_activity WHERE client_port = ANY(%s)",
                (sorted(set().union(*ports.values())),),
            ).fetchall()
            blocked = Counter(next(p for p, ps in ports.items() if port in ps) for _, port, waits in rows if waits)
            if all(blocked[p.pid] == workers for p in procs):
                return [int(pid) for pid, _, _ in rows]
            if time.monotonic() > deadline:
                raise SystemExit(f"relays not at the gate after 60 s: blocked workers per process {dict(blocked)}")
            time.sleep(0.1)


def fill_backlog(dsn: str, names: OutboxNames, events: list[Event], per_transaction: int) -> None:
    """The backlog as producers write it: ``per_transaction`` events per transaction, each
    committed on its own (the ingest numbers committed transactions, a turn at a time).
    Many transactions per round trip, and without waiting for the WAL flush: this is
    the setup, not the measurement."""
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        insert = sql.SQL("INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ").format(table)
        prefix = insert.as_string(conn)
        chunk: list[str] = []
        for i in range(0, len(events), per_transaction):
            values = ", ".join(
                f"('order', {sql.Literal(a).as_string(conn)}, {sql.Literal(t).as_string(conn)},"
                f" {sql.Literal(p).as_string(conn)})"
                for a, t, p in events[i : i + per_transaction]
            )
            chunk.append(f"BEGIN; {prefix}{values}; COMMIT;")
            if len(chunk) == 500:
                conn.execute("\n".join(chunk).encode())
                chunk = []
        if chunk:
            conn.execute("\n".join(chunk).encode())
        conn.execute(sql.SQL("ANALYZE {}").format(table))


def run_once(
    args: argparse.Namespace, round_no: int, leg: str, processes: int, events: list[Event], exchange: str
) -> Result:
    names = OutboxNames(SCHEMA)
    reset_outbox(args.dsn, names)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    command = [
        *relay_bin(), "start", "--dsn", args.dsn, "--schema", names.schema,
        "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--log-level", "warning",
    ]  # fmt: skip
    if leg == "db":
        command += ["--broker", "log"]
    else:
        command += ["--broker", "rabbitmq", "--amqp-url", args.amqp_url, "--exchange", exchange]
        command += ["--routing-key", "{event_type}"]
    logs = [Path(tempfile.gettempdir()) / f"bench-scale-{leg}-{processes}-{i}.log" for i in range(processes)]
    procs: list[subprocess.Popen[bytes]] = []
    table = sql.Identifier(names.schema, names.table)
    # Both probes go through the partial indexes of unfinished rows: cheap beside the drain.
    busy_q = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending')"
        " OR EXISTS (SELECT 1 FROM {t} WHERE status = 'processing')"
    ).format(t=table)
    unnumbered_q = sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {t} WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL)"
    ).format(t=table)
    fill_backlog(args.dsn, names, events, args.per_transaction)
    gate: psycopg.Connection[Any] | None = None
    try:
        # The gate: while this lock is held, every worker's first claim waits for it, so
        # all processes start on the backlog at the same moment, however long each took
        # to start up.
        gate = psycopg.connect(args.dsn, application_name="bench-scale-gate")
        gate.execute(sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(table))
        for log in logs:
            with log.open("wb") as err:
                procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env))
        backends = wait_blocked(args.dsn, procs, args.workers, logs)
        ours = [p.pid for p in procs]
        pg_bg = pg_background(pids_named("postgres"))
        rabbit = pids_named("beam.smp") if leg == "rabbitmq" else []
        sampler = Sampler(args.dsn, backends, names)
        with psycopg.connect(args.dsn, autocommit=True, application_name="bench-scale") as conn:
            before = snapshot([*ours, *backends, *pg_bg, *rabbit])
            gate.commit()
            t0_db = fetch(conn, "SELECT clock_timestamp()")[0]
            t0 = time.perf_counter()
            sampler.start()
            ingest_s = None
            while True:
                if ingest_s is None and not fetch(conn, unnumbered_q)[0]:
                    ingest_s = time.perf_counter() - t0
                if not fetch(conn, busy_q)[0]:
                    break
                for proc, log in zip(procs, logs, strict=True):
                    if proc.poll() is not None:
                        raise SystemExit(f"relay exited: {log.read_text()[-2000:]}")
                time.sleep(SAMPLE_S)
            after = snapshot([*ours, *backends, *pg_bg, *rabbit])
            sampler.stop.set()
            sampler.join()
            done, dead, last = fetch(
                conn,
                sql.SQL(
                    "SELECT count(*) FILTER (WHERE status = 'done'), count(*) FILTER (WHERE status = 'dead'),"
                    " max(done_at) FROM {}"
                ).format(table),
            )
        if done != len(events) or dead:
            raise SystemExit(f"{leg} x{processes}: {done} done, {dead} dead of {len(events)}")
        seconds = (last - t0_db).total_seconds()
    finally:
        if gate is not None:
            gate.close()  # rolls back whatever it still holds: the lock goes with it
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)

    def spent(pids: Sequence[int]) -> float:
        return sum(max(0.0, after.per_pid.get(p, 0.0) - before.per_pid.get(p, 0.0)) for p in set(pids))

    wall = after.wall - before.wall
    cpu = {
        "relay": spent(ours),
        "pg backends": spent(backends),
        "pg background": spent(pg_bg),
        "rabbitmq": spent(rabbit),
    }
    cpu["not ours"] = max(0.0, (after.machine - before.machine) - sum(cpu.values()))
    return Result(
        round=round_no,
        leg=leg,
        processes=processes,
        rate=len(events) / seconds,
        seconds=seconds,
        cpu=cpu,
        machine_cores=(after.machine - before.machine) / wall,
        states=sampler.states,
        statements=sampler.statements,
        locks=sampler.locks,
        samples=sampler.samples,
        sessions=len(procs) * (args.workers + 1),
        ingest_s=ingest_s,
        disturbed=next(
            (line for log in logs for line in log.read_text(errors="replace").splitlines() if " WARNING " in line),
            None,
        ),
    )


# -- RabbitMQ topology ----------------------------------------------------------------


@contextmanager
def rabbit_topology(url: str, wanted: bool) -> Iterator[tuple[str, Callable[[], None], Callable[[], int]]]:
    """A direct exchange and one durable queue bound to every event type; yields the
    exchange name, a purge function and a function counting the queue's messages."""
    tag = uuid.uuid4().hex[:8]
    name = f"bench-scale-{tag}"

    async def connect() -> Any:
        # The broker may be in the middle of another suite's restart: wait up to a minute.
        for attempt in range(60):
            try:
                return await aio_pika.connect(url)
            except aio_pika.exceptions.AMQPConnectionError:
                if attempt == 59:
                    raise
                await asyncio.sleep(1)

    async def setup() -> None:
        conn = await connect()
        async with conn:
            ch = await conn.channel()
            exchange = await ch.declare_exchange(name, "direct", durable=True)
            queue = await ch.declare_queue(name, durable=True)
            for event_type in EVENT_TYPES:
                await queue.bind(exchange, event_type)

    async def purge() -> None:
        conn = await connect()
        async with conn:
            ch = await conn.channel()
            queue = await ch.get_queue(name, ensure=False)
            await queue.purge()

    async def count() -> int:
        conn = await connect()
        async with conn:
            ch = await conn.channel()
            queue = await ch.declare_queue(name, passive=True)
            return int(queue.declaration_result.message_count or 0)

    async def teardown() -> None:
        conn = await connect()
        async with conn:
            ch = await conn.channel()
            await ch.queue_delete(name)
            await ch.exchange_delete(name)

    if not wanted:  # the database legs alone need no broker
        yield name, lambda: None, lambda: 0
        return
    asyncio.run(setup())
    try:
        yield name, lambda: asyncio.run(purge()), lambda: asyncio.run(count())
    finally:
        asyncio.run(teardown())


# -- the log broker's own cost --------------------------------------------------------


def log_broker_cost(events: list[Event], batch: int) -> float:
    """CPU seconds per 10,000 messages of LogPublisher.publish writing to /dev/null."""
    messages = [
        OutboxMessage(
            id=i,
            aggregate_type="order",
            aggregate_id=a,
            event_type=t,
            body=p.encode(),
            attempt=1,
            lease_version=1,
            ordered=t != UNORDERED_TYPE,
            aggregate_seq=i,
        )
        for i, (a, t, p) in enumerate(events, start=1)
    ]

    async def publish_all(publisher: LogPublisher) -> None:
        for i in range(0, len(messages), batch):
            await publisher.publish(messages[i : i + batch])

    with open(os.devnull, "w") as devnull:
        publisher = LogPublisher(devnull)
        started = time.process_time()
        asyncio.run(publish_all(publisher))
        return (time.process_time() - started) / len(messages) * 10_000


# -- report ---------------------------------------------------------------------------


def top(counter: Counter[str], n: int) -> str:
    total = sum(counter.values())
    if not total:
        return "—"
    return ", ".join(f"{k} {v / total:.0%}" for k, v in counter.most_common(n))


def summarize(results: list[Result], leg: str, markdown: bool) -> None:
    by_n: dict[int, list[Result]] = {}
    for r in results:
        if r.leg == leg:
            by_n.setdefault(r.processes, []).append(r)
    if not by_n:
        return
    # Each round's rate against the same round's 1-process run (back to back, under about
    # the same load from others), then the median of those ratios.
    base = {r.round: r.rate for r in by_n[min(by_n)]}
    header = [
        "processes x workers",
        "rate (median; rounds)",
        "vs 1",
        "CPU s / 10k msgs: " + " / ".join(GROUPS),
        "machine busy (of 2 cores)",
        "busy relay sessions (of pool)",
        "our CPU per msg -> 2-core ceiling",
        "top 3 of busy session samples",
        "heavyweight lock waits (which, of them)",
        "top 3 statements (active samples)",
        "every ordered row numbered after",
        "load avg (1 min) at end of each run",
    ]
    rows = []
    for n, rs in sorted(by_n.items()):
        rate = statistics.median(r.rate for r in rs)
        per10k = [statistics.median(r.cpu[g] / (r.rate * r.seconds) * 10_000 for r in rs) for g in GROUPS]
        states: Counter[str] = Counter()
        statements: Counter[str] = Counter()
        lock_waits: Counter[str] = Counter()
        for r in rs:
            lock_waits.update(r.locks)
            states.update({k: v for k, v in r.states.items() if k != "idle"})
            statements.update(r.statements)
        samples = sum(r.samples for r in rs)
        busy = sum(states.values()) / samples if samples else 0.0
        ingest = [r.ingest_s for r in rs if r.ingest_s is not None]
        ours = statistics.median(sum(r.cpu[g] for g in GROUPS if g != "not ours") / (r.rate * r.seconds) for r in rs)
        locks = sum(v for k, v in states.items() if k.startswith("Lock:"))
        flagged = sum(r.disturbed is not None for r in rs)
        rows.append(
            [
                f"{n} x {rs[0].sessions // n - 1}" + (f" ({flagged} run disturbed)" if flagged else ""),
                f"{rate:,.0f}/s (" + ", ".join(f"{r.rate:,.0f}" for r in rs) + ")",
                f"{statistics.median(r.rate / base[r.round] for r in rs if r.round in base):.2f}x",
                " / ".join(f"{v:.2f}" for v in per10k),
                f"{statistics.median(r.machine_cores for r in rs):.2f}",
                f"{busy:.1f} of {rs[0].sessions}",
                f"{ours * 1e6:.0f} µs -> {2 / ours:,.0f}/s",
                top(states, 3),
                f"{locks / max(1, sum(states.values())):.1%}" + (f" ({top(lock_waits, 2)})" if locks else ""),
                top(statements, 3),
                f"{statistics.median(ingest):.2f} s" if ingest else "—",
                ", ".join(f"{r.load[0]:.1f}" for r in rs),
            ]
        )
    title = "database legs (--broker log to /dev/null)" if leg == "db" else "RabbitMQ (publisher confirms)"
    print(f"\n{title}")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        for row in rows:
            print()
            for h, c in zip(header, row, strict=True):
                print(f"  {h:<{max(map(len, header))}}  {c}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--amqp-url", default=os.environ.get("RELAY_TEST_AMQP_URL", DEFAULT_AMQP_URL))
    ap.add_argument("--leg", choices=["db", "rabbitmq"], action="append", help="default: both")
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--aggregates", type=int, default=2_000)
    ap.add_argument("--payload-bytes", type=int, default=200)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--workers", type=int, default=2, help="per process")
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--per-transaction", type=int, default=1, help="events per producer transaction in the backlog")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes, one round: a smoke run")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.messages, a.rounds = 4_000, 1
    legs = a.leg or ["db", "rabbitmq"]
    events = make_events(a.messages, a.aggregates, a.payload_bytes)
    with psycopg.connect(a.dsn) as conn:
        version = fetch(conn, "SHOW server_version")[0]
        autovacuum = fetch(conn, "SHOW autovacuum")[0]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()},"
        f" PostgreSQL {version} (autovacuum {autovacuum}); {a.messages:,} messages of {a.payload_bytes} B"
        f" per run, 80% ordered over {a.aggregates:,} aggregates; batch {a.batch_size}; load average at start"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    results: list[Result] = []
    try:
        with rabbit_topology(a.amqp_url, "rabbitmq" in legs) as (exchange, purge, queued):
            for round_no in range(1, a.rounds + 1):
                order = a.processes if round_no % 2 else list(reversed(a.processes))
                for leg in legs:
                    for n in order:
                        if leg == "rabbitmq":
                            purge()
                        # This cluster is shared: a fault test elsewhere may kill every
                        # 'outbox-relay' session. A run whose relays logged a warning is run
                        # again (up to twice), and kept, flagged, if it is disturbed each time.
                        for _attempt in range(3):
                            r = run_once(a, round_no, leg, n, events, exchange)
                            if r.disturbed is None:
                                break
                            print(f"disturbed run, again: {r.disturbed}", file=sys.stderr, flush=True)
                        if leg == "rabbitmq" and queued() < len(events):
                            raise SystemExit(f"rabbitmq x{n}: {queued()} of {len(events)} messages in the queue")
                        results.append(r)
                        print(
                            f"round {round_no}, {leg}, {n} processes: {r.rate:,.0f} msg/s in {r.seconds:.1f} s;"
                            f" CPU s " + ", ".join(f"{g} {r.cpu[g]:.1f}" for g in GROUPS) + f";"
                            f" machine {r.machine_cores:.2f} cores; load {r.load[0]:.2f}",
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        with psycopg.connect(a.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    for leg in legs:
        summarize(results, leg, a.markdown)
    if "db" in legs:
        print(
            f"\nthe log broker alone (same messages, this process, to /dev/null):"
            f" {log_broker_cost(events, a.batch_size):.2f} CPU s per 10k msgs; it is inside the relay column"
        )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
