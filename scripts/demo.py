"""outbox-relay end to end in one command: PostgreSQL -> relay -> SQS FIFO -> a consumer's verdict.

    .venv/bin/python scripts/demo.py                        # embedded SQS (moto), local PostgreSQL
    .venv/bin/python scripts/demo.py --orders 300 --workers 6
    .venv/bin/python scripts/demo.py --crash      # SIGKILL the relay mid-drain, start another
    .venv/bin/python scripts/demo.py --endpoint-url http://127.0.0.1:4566   # an SQS you run
    .venv/bin/python scripts/demo.py --dsn postgresql://me@db.example/app --database my_demo

1. creates the demo's own database (``--database``, default ``outbox_relay_demo``) on the
   PostgreSQL server of ``--dsn`` / ``RELAY_DSN`` unless it is there, migrates a fresh
   ``relay_demo`` schema in it (nothing else on the server is touched) and stores its
   ordering map (``Order*`` ordered, the rest not), shared by every relay;
2. starts an embedded SQS (moto's ThreadedMotoServer on a free 127.0.0.1 port) unless
   ``--endpoint-url`` is given, and creates two FIFO queues: one for the orders' events,
   one for the customer notifications;
3. runs ``relay start --broker sqs`` as a subprocess with several workers and a route
   (``--route CustomerNotified,ReceiptEmailed=<notifications queue>``; the rest goes to
   ``--queue-url``, the orders queue), and concurrent
   producers writing the life of each order (OrderCreated, OrderItemAdded, OrderPaid,
   OrderShipped, OrderDelivered... in order; notifications unordered) in their own
   transactions, each producer owning its orders so that id order is commit order;
4. prints progress every second while the outbox drains, stops the relay with SIGTERM;
5. reads both queues back and prints a verdict: every event delivered to its family's
   queue, duplicates, and per-order sequence held. Exit code 0 when the verdict holds, 1 when it does not.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.dsn import describe_dsn, mask
from relay.errors import ConfigError, first_line
from relay.ordering import OrderingMap

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"  # the server; its database only to create ours
DATABASE = "outbox_relay_demo"  # the demo's own: never a database someone else uses
SCHEMA = "relay_demo"
QUEUE = "relay-demo-orders.fifo"  # the default destination: the order's own events
# A route sends the customer-facing notifications to a queue of their own.
NOTIFY_QUEUE = "relay-demo-notifications.fifo"
NOTIFICATIONS = ("CustomerNotified", "ReceiptEmailed")
ORDERED = "Order*"  # the order's own events, in sequence; notifications may overtake them
ORDERING = OrderingMap(default_ordered=False, ordered=(ORDERED,))
ORDERING_FLAGS = ("--ordering-default", "unordered", "--ordered", ORDERED)  # the same map, for relay migrate
DEADLINE_S = 45  # the whole drain; the demo promises to end within a minute
FAKE_AWS = {
    "AWS_ACCESS_KEY_ID": "demo",
    "AWS_SECRET_ACCESS_KEY": "demo",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"outbox-relay demo: {args.orders} orders from {args.producers} producers, relay with {args.workers} workers")
    try:
        args.dsn = own_database(args.dsn, args.database)
        migrate(args.dsn)
    except (psycopg.Error, subprocess.CalledProcessError, ConfigError) as exc:
        why = mask(first_line(exc))
        print(f"demo: cannot prepare PostgreSQL ({why}); pass --dsn or set RELAY_DSN", file=sys.stderr)
        return 2
    with sqs_endpoint(args.endpoint_url) as (endpoint, aws_env):
        client = boto3.client("sqs", endpoint_url=endpoint, region_name=args.region)
        url, notify_url = fresh_queue(client, QUEUE), fresh_queue(client, NOTIFY_QUEUE)
        print(f"[sqs] FIFO queue {url} (orders), {notify_url} (notifications, by a route)")
        verdict = run(args, endpoint, (url, notify_url), aws_env, client)
    print()
    for line in verdict.lines():
        print(line)
    return 0 if verdict.ok else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument(
        "--dsn",
        default=os.environ.get("RELAY_DSN", DEFAULT_DSN),
        help="the PostgreSQL server, and a database there to connect to while creating --database"
        " (default: %(default)s)",
    )
    p.add_argument(
        "--database",
        default=DATABASE,
        help="the demo's own database on that server, created if absent (default: %(default)s)",
    )
    p.add_argument("--endpoint-url", default=None, help="an SQS-compatible endpoint; default: start an embedded one")
    p.add_argument("--region", default="us-east-1")
    p.add_argument("--orders", type=int, default=150, help="orders to simulate (about 8 events each)")
    p.add_argument("--producers", type=int, default=4, help="concurrent producer connections")
    p.add_argument("--workers", type=int, default=4, help="relay workers")
    p.add_argument("--seed", type=int, default=None, help="random seed, for a repeatable stream")
    p.add_argument("--crash", action="store_true", help="SIGKILL the relay mid-drain and start another")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------
# PostgreSQL


def relay_bin() -> list[str]:
    script = Path(sys.executable).with_name("relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


def own_database(dsn: str, database: str) -> str:
    """``dsn`` pointed at ``database`` on the same server, created first if absent: the demo
    drops and recreates its schema each run, so it never works in a database of anyone else's
    (it once ran in the shared ``test`` database by default)."""
    demo_dsn = make_conninfo(dsn, dbname=database)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone() is None:
            with contextlib.suppress(psycopg.errors.DuplicateDatabase):  # another demo made it just now
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
            print(f"[postgres] created database {database!r}")
    print(f"[postgres] {describe_dsn(demo_dsn)}")
    return demo_dsn


def migrate(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
    done = subprocess.run(
        # The ordering map is shared by every relay of the outbox, and routes each row when
        # it is inserted: stored once here, before any producer writes; relay start only reads it.
        [*relay_bin(), "migrate", "--dsn", dsn, "--schema", SCHEMA, *ORDERING_FLAGS],
        capture_output=True,
        text=True,
        check=True,
        env=relay_env({}),
    )
    for line in done.stdout.splitlines():
        print(f"[postgres] {line}")


def relay_env(aws_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(aws_env)
    return env


def statuses(conn: psycopg.Connection[Any]) -> Counter[str]:
    cur = conn.execute(
        sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(sql.Identifier(SCHEMA, "outbox"))
    )
    return Counter({status: n for status, n in cur.fetchall()})


# ---------------------------------------------------------------------------------------
# SQS


@contextlib.contextmanager
def sqs_endpoint(given: str | None) -> Iterator[tuple[str, dict[str, str]]]:
    """The endpoint to use and the AWS variables the relay needs for it."""
    if given:
        print(f"[sqs] using {given} (credentials from your AWS environment)")
        yield given, {}
        return
    os.environ.update(FAKE_AWS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    speed_up_moto()
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    print(f"[sqs] embedded SQS (moto) on {endpoint}")
    try:
        yield endpoint, dict(FAKE_AWS)
    finally:
        server.stop()


def speed_up_moto() -> None:
    """moto refreshes its approximate message counters on every message sent by reading
    the clock (slowly) for every message in the queue, so its cost per message grows with
    the queue, and a relay draining a backlog overloads it. The same clock read with
    ``time.time()``, and the counters (which the demo never reads) answering 0, keep it
    flat. Delivery, FIFO groups and de-duplication are untouched (see tests/sqs_server.py)."""
    import moto.sqs.models

    models: Any = moto.sqs.models
    slow_seconds, slow_millis = models.unix_time, models.unix_time_millis

    def unix_time(dt: Any = None) -> float:
        return time.time() if dt is None else float(slow_seconds(dt))

    def unix_time_millis(dt: Any = None) -> float:
        return time.time() * 1000.0 if dt is None else float(slow_millis(dt))

    models.unix_time, models.unix_time_millis = unix_time, unix_time_millis
    for counter in (
        "approximate_number_of_messages",
        "approximate_number_of_messages_delayed",
        "approximate_number_of_messages_not_visible",
    ):
        setattr(models.Queue, counter, property(lambda self: 0))


def fresh_queue(client: Any, name: str) -> str:
    with contextlib.suppress(client.exceptions.QueueDoesNotExist):
        old = client.get_queue_url(QueueName=name)["QueueUrl"]
        client.delete_queue(QueueUrl=old)
    url: str = client.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})["QueueUrl"]
    return url


@dataclass(frozen=True)
class Received:
    outbox_id: int
    group: str
    event_type: str
    body: dict[str, Any]
    aggregate_seq: int | None  # ordered events only: 1, 2, 3, ... per order


def read_back(client: Any, url: str) -> list[Received]:
    """Everything in the queue, in the order SQS hands it out, deleting as a consumer would."""
    got: list[Received] = []
    empty = 0
    while empty < 3:  # a few empty receives in a row: the queue is drained
        answer = client.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=0,
            MessageAttributeNames=["All"],
            MessageSystemAttributeNames=["MessageGroupId"],
        )
        messages = answer.get("Messages", [])
        if not messages:
            empty += 1
            time.sleep(0.05)
            continue
        empty = 0
        for m in messages:
            attrs = m["MessageAttributes"]
            got.append(
                Received(
                    outbox_id=int(attrs["outbox_id"]["StringValue"]),
                    group=m["Attributes"]["MessageGroupId"],
                    event_type=attrs["event_type"]["StringValue"],
                    body=json.loads(m["Body"]),
                    aggregate_seq=int(attrs["aggregate_seq"]["StringValue"]) if "aggregate_seq" in attrs else None,
                )
            )
        client.delete_message_batch(
            QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)]
        )
    return got


# ---------------------------------------------------------------------------------------
# Producers


def order_story(rng: random.Random, number: int) -> tuple[str, list[list[tuple[str, dict[str, Any]]]]]:
    """One order's life as the transactions a service would commit, events in each."""
    order = f"ord-{number:05d}"
    customer = f"cus-{rng.randrange(10_000, 99_999)}"
    txs: list[list[tuple[str, dict[str, Any]]]] = [
        [
            ("OrderCreated", {"order_id": order, "customer_id": customer, "currency": "EUR", "at": now()}),
            ("CustomerNotified", {"order_id": order, "template": "order-received", "to": customer}),
        ]
    ]
    total = 0
    for line in range(rng.randint(1, 4)):
        price = rng.randrange(199, 9_999)
        qty = rng.randint(1, 3)
        total += price * qty
        txs.append(
            [("OrderItemAdded", {"order_id": order, "line": line + 1, "sku": f"SKU-{rng.randrange(1000, 9999)}",
                                 "qty": qty, "unit_price_cents": price})]
        )  # fmt: skip
    if rng.random() < 0.1:
        txs.append([("OrderCancelled", {"order_id": order, "reason": "customer-request", "at": now()})])
        return order, txs
    method = rng.choice(["card", "paypal", "sepa"])
    txs.append(
        [
            ("OrderPaid", {"order_id": order, "amount_cents": total, "method": method, "at": now()}),
            ("ReceiptEmailed", {"order_id": order, "to": customer, "amount_cents": total}),
        ]
    )
    txs.append(
        [
            ("OrderShipped", {"order_id": order, "carrier": rng.choice(["DHL", "UPS", "GLS"]),
                              "tracking": f"TRK{rng.randrange(10**9, 10**10)}", "at": now()}),
            ("CustomerNotified", {"order_id": order, "template": "order-shipped", "to": customer}),
        ]
    )  # fmt: skip
    txs.append([("OrderDelivered", {"order_id": order, "at": now()})])
    return order, txs


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


class Producer(threading.Thread):
    """One service instance: its own connection, its own orders (so no other producer ever
    writes an event of the same order), several orders in progress at once."""

    def __init__(self, dsn: str, orders: list[int], seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.orders, self.rng = dsn, orders, random.Random(seed)
        self.written = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _produce(self) -> None:
        insert = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s)"
        ).format(sql.Identifier(SCHEMA, "outbox"))
        stories = [order_story(self.rng, n) for n in self.orders]
        active: list[tuple[str, list[list[tuple[str, dict[str, Any]]]]]] = []
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while stories or active:
                while stories and len(active) < 8:
                    active.append(stories.pop(0))
                order, txs = active[self.rng.randrange(len(active))]
                events = txs.pop(0)
                with conn.transaction():
                    for event_type, payload in events:
                        conn.execute(insert, ("order", order, event_type, json.dumps(payload)))
                self.written += len(events)
                if not txs:
                    active = [a for a in active if a[0] != order]
                time.sleep(self.rng.uniform(0, 0.004))  # a busy service, not a bulk load


# ---------------------------------------------------------------------------------------
# The run and the verdict


@dataclass
class Verdict:
    written: int = 0
    done: int = 0
    dead: int = 0
    received: int = 0
    distinct: int = 0
    missing: int = 0
    order_breaks: int = 0
    seq_breaks: int = 0  # first deliveries whose aggregate_seq is not the previous one + 1
    groups: int = 0
    relay_exit: int | None = None
    drained: bool = False
    seconds: float = 0.0
    reclaimed: int | None = None  # rows claimed more than once (--crash)
    per_queue: tuple[int, int] = (0, 0)  # messages read from the orders and the notifications queue
    misrouted: int = 0  # messages found in the other family's queue
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        rate = self.done / self.seconds if self.seconds else 0.0
        out = [
            "verdict",
            f"  events written              {self.written}",
            f"  delivered (outbox done)     {self.done}, {self.seconds:.1f}s from the first write ({rate:.0f}/s)"
            f"   dead: {self.dead}",
            f"  messages read from SQS      {self.received}   orders queue {self.per_queue[0]},"
            f" notifications queue {self.per_queue[1]} (by a route)   misrouted: {self.misrouted}",
            f"  distinct outbox ids         {self.distinct}   missing: {self.missing}",
            f"  duplicates seen by consumer {self.received - self.distinct}"
            + (f"   (rows claimed again after the crash: {self.reclaimed})" if self.reclaimed is not None else ""),
            f"  orders (message groups)     {self.groups}   sequence breaks: {self.order_breaks}"
            f"   aggregate_seq gaps: {self.seq_breaks}",
            f"  relay exit code on SIGTERM  {self.relay_exit}",
        ]
        if self.ok:
            out.append(
                "PASS: every event arrived exactly once, in its family's queue, each order's events in sequence"
                " (aggregate_seq 1, 2, 3, ...)"
            )
        else:
            out.extend(f"FAIL: {p}" for p in self.problems)
        return out


class Relay:
    """``relay start`` in a subprocess, its log in a file."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.command, self.env, self.log_path = command, env, log_path
        self.log_path.write_text("")
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0  # processes started so far, each logging "relay started" once up

    def start(self) -> None:
        self.starts += 1
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=log, env=self.env)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def started(self) -> bool:
        """Wait until the latest process says it is running, or exits (its SIGTERM handler is
        in place from then on)."""
        return wait_for(
            lambda: self.log_path.read_text().count("relay started") >= self.starts or self.exit_code() is not None, 20
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def run(
    args: argparse.Namespace, endpoint: str, urls: tuple[str, str], aws_env: dict[str, str], client: Any
) -> Verdict:
    log_path = Path(tempfile.gettempdir()) / "relay-demo.log"
    url, notify_url = urls
    command = [
        *relay_bin(), "start", "--dsn", args.dsn, "--schema", SCHEMA,
        "--broker", "sqs", "--queue-url", url, "--endpoint-url", endpoint, "--region", args.region,
        "--route", f"{','.join(NOTIFICATIONS)}={notify_url}", "--workers", str(args.workers),
    ]  # fmt: skip
    if args.crash:
        # A killed relay's leases must run out before another relay may take its rows:
        # short leases, and SQS calls short enough to fit inside the publish deadline.
        command += ["--lease", "5s", "--publish-timeout", "4s", "--sqs-sdk-attempts", "1",
                    "--sqs-connect-timeout", "500ms", "--sqs-read-timeout", "3s"]  # fmt: skip
    print(f"[relay] {' '.join(command[1:])}")
    print(f"[relay] log: {log_path}")
    verdict = Verdict()
    relay = Relay(command, relay_env(aws_env), log_path)
    relay.start()
    try:
        if not relay.started() or relay.exit_code() is not None:
            verdict.problems = (f"the relay did not start (exit code {relay.exit_code()})",)
            return finish(verdict, log_path)
        verdict = drain(args, relay, verdict)
    finally:
        verdict.relay_exit = relay.stop()
    print(f"[relay] stopped with SIGTERM, exit code {verdict.relay_exit}")
    orders, notifications = read_back(client, url), read_back(client, notify_url)
    verdict.per_queue = (len(orders), len(notifications))
    verdict.misrouted = sum(1 for r in orders if r.event_type in NOTIFICATIONS) + sum(
        1 for r in notifications if r.event_type not in NOTIFICATIONS
    )
    return judge(verdict, [*orders, *notifications], args.dsn, log_path)


def drain(args: argparse.Namespace, relay: Relay, verdict: Verdict) -> Verdict:
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    producers = [
        Producer(args.dsn, list(range(k, args.orders, args.producers)), seed + k) for k in range(args.producers)
    ]
    start = time.monotonic()
    for p in producers:
        p.start()
    crash_at = 3.0 if args.crash else None
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        last = 0
        while True:
            time.sleep(1)
            counts = statuses(conn)
            written = sum(counts.values())
            producing = any(p.is_alive() for p in producers)
            elapsed = time.monotonic() - start
            print(
                f"[{elapsed:5.1f}s] written {written:5d}{' (producing)' if producing else '            '}"
                f"  delivered {counts['done']:5d} (+{counts['done'] - last:4d}/s)"
                f"  pending {counts['pending']:4d}  in flight {counts['processing']:3d}  dead {counts['dead']}"
            )
            last = counts["done"]
            if crash_at is not None and elapsed >= crash_at:
                crash_at = None
                relay.kill()
                print("[relay] killed with SIGKILL mid-drain; starting another (the dead one's leases expire in 5s)")
                relay.start()
                relay.started()
            if relay.exit_code() is not None:
                verdict.problems = (f"the relay exited while draining (code {relay.exit_code()})",)
                break
            if not producing and counts["done"] + counts["dead"] == written:
                verdict.drained = True
                break
            if elapsed > DEADLINE_S:
                verdict.problems = (f"not drained within {DEADLINE_S}s",)
                break
        verdict.seconds = time.monotonic() - start
        if args.crash:
            cur = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE lease_version > 1").format(sql.Identifier(SCHEMA, "outbox"))
            )
            row = cur.fetchone()
            verdict.reclaimed = row[0] if row else 0
    for p in producers:
        p.join()
        if p.error is not None:
            verdict.problems = (*verdict.problems, f"a producer failed: {first_line(p.error)}")
    return verdict


def judge(verdict: Verdict, got: list[Received], dsn: str, log_path: Path) -> Verdict:
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = statuses(conn)
        cur = conn.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(SCHEMA, "outbox")))
        ids = {row[0] for row in cur.fetchall()}
    verdict.written, verdict.done, verdict.dead = sum(counts.values()), counts["done"], counts["dead"]
    verdict.received = len(got)
    verdict.distinct = len({r.outbox_id for r in got})
    verdict.missing = len(ids - {r.outbox_id for r in got})
    sequences: dict[str, list[int]] = defaultdict(list)
    for r in got:
        if ORDERING.is_ordered(r.event_type):
            sequences[r.group].append(r.outbox_id)
    verdict.groups = len(sequences)
    verdict.order_breaks = sum(1 for s in sequences.values() for a, b in itertools.pairwise(s) if b < a)
    # What a consumer checks with aggregate_seq: each order's first deliveries read 1, 2, 3, ...
    numbers: dict[str, list[int | None]] = defaultdict(list)
    seen: set[int] = set()
    for r in got:
        if ORDERING.is_ordered(r.event_type) and r.outbox_id not in seen:
            seen.add(r.outbox_id)
            numbers[r.group].append(r.aggregate_seq)
    verdict.seq_breaks = sum(1 for s in numbers.values() for i, n in enumerate(s) if n != i + 1)
    if got:
        sample = next((r for r in got if r.event_type == "OrderPaid"), got[0])
        print(
            f"[consumer] e.g. group {sample.group}: {sample.event_type} #{sample.outbox_id} {json.dumps(sample.body)}"
        )
    problems = list(verdict.problems)
    if verdict.missing:
        problems.append(f"{verdict.missing} outbox events never reached the queue")
    if verdict.received != verdict.distinct:
        problems.append(f"{verdict.received - verdict.distinct} duplicates reached the consumer")
    if verdict.order_breaks:
        problems.append(f"{verdict.order_breaks} events arrived before an earlier event of their order")
    if verdict.seq_breaks:
        problems.append(f"{verdict.seq_breaks} ordered events arrived with an aggregate_seq out of sequence")
    if verdict.misrouted:
        problems.append(f"{verdict.misrouted} messages reached the other event family's queue")
    if verdict.dead:
        problems.append(f"{verdict.dead} messages went to dead")
    if verdict.relay_exit != 0:
        problems.append(f"the relay exited with code {verdict.relay_exit} on SIGTERM")
    verdict.problems = tuple(problems)
    return finish(verdict, log_path)


def finish(verdict: Verdict, log_path: Path) -> Verdict:
    if verdict.problems:
        tail = log_path.read_text().splitlines()[-15:]
        print("[relay] last log lines:\n  " + "\n  ".join(tail))
    return verdict


def wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    sys.exit(main())
