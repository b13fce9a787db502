"""RabbitMQ leg benchmark: the relay end to end versus plain aio-pika with confirms, same
broker, same run.

    .venv/bin/python scripts/bench_rabbitmq.py                  # 20,000 messages, 3 rounds
    .venv/bin/python scripts/bench_rabbitmq.py --messages 50000 --workers 4
    .venv/bin/python scripts/bench_rabbitmq.py --ordered        # every event ordered per aggregate

Both sides send the same messages (same bodies, same properties and six headers, built by
the adapter's own ``envelope.build``) as persistent, mandatory messages to a durable queue
behind a direct exchange, on confirm channels:

- raw: aio-pika alone, no database: every message of a batch published at once
  (``asyncio.gather``), confirms awaited together, batch after batch, on 1, 2, 4 and 8
  channels side by side, the messages built before the clock starts; once with
  ``Exchange.publish`` (aio-pika's own call) and once with aiormq's
  ``basic_publish(wait=False)`` underneath it (the call the adapter makes). The best of
  all eight is the baseline, so the relay is not measured against a slower client path
  than its own.
- relay: ``relay start --broker rabbitmq`` as a subprocess draining an outbox pre-filled
  with those events, timed from the first row leaving 'pending' to every row 'done'
  (PostgreSQL claim, publish with confirms, fenced finalize: the whole path);
- relay, unpipelined (``--compare-unpipelined``): the same with ``--no-pipeline``, in the
  same round, so the two dispatch loops are compared under the same load.
- relay, traced (``--compare-otel``): the same with ``--otel`` and ``OTEL_TRACES_EXPORTER=none``,
  in the same round: the spans are made and the messages carry their traceparent, but
  nothing is exported, so the cost is the tracing's own, not a collector's.
- minimal relay: a relay written in one function against the design reference's schema
  (scripts/bench_db.py's table and tuned batched claim, with the head-of-aggregate NOT
  EXISTS when ``--ordered``): each of ``--workers`` loops claims a batch, publishes it with
  confirms (aiormq's ``basic_publish`` under aio-pika, the messages carrying the relay's
  properties and the reference's headers), then writes one fenced finalize for the batch.
  Same events, workers, batch and queue, every round: issue 40's goal is the relay at
  >= 0.9x of it.
- baseline relay (``--baseline-relay PATH``): another checkout's ``relay`` executable (say,
  the branch's base in a venv of its own), also in every round: before and after a change
  under the same load.

Each relay line also says where the CPU went while it ran: the relay process, every
PostgreSQL process, RabbitMQ (its beam.smp, when this user may read it), and the rest of
the machine (anyone else's work): the machine has only so many cores.

Each round purges the queue first, so neither side pays for a longer queue. The script
prints both rates, their ratio, and the median over the rounds. The goal is a ratio of at
least 0.9. It needs PostgreSQL and RabbitMQ (defaults: the local test services) and leaves
nothing behind: its schema, exchange and queue are deleted at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, cast

import aio_pika
import aio_pika.abc
import aiormq
import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.adapters.rabbitmq.envelope import Envelope, build
from relay.adapters.rabbitmq.publisher import RabbitPublisher
from relay.adapters.rabbitmq.settings import RabbitSettings, RoutingKeyTemplate
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.message import OutboxMessage
from relay.ordering import OrderingMap
from scripts import progress
from scripts.bench_db import BASE_DONE_BATCH, BASE_SCHEMA, CEIL_CLAIM, CEIL_HEAD, LEASE, base_sql, reset_base
from scripts.procstat import command_cpu, machine_busy, process_cpu

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
EVENT_TYPES = ("OrderPlaced", "OrderPaid", "OrderShipped", "OrderDelivered")
RAW_CHANNELS = (1, 2, 4, 8)
RAW_STYLES = ("exchange", "nowait")

Event = tuple[str, str, dict[str, Any]]


def make_events(n: int, aggregates: int, payload_bytes: int, seed: int = 7) -> list[Event]:
    rnd = random.Random(seed)
    filler = "x" * max(0, payload_bytes - 60)
    return [
        (f"order-{rnd.randrange(aggregates)}", EVENT_TYPES[i % len(EVENT_TYPES)], {"seq": i, "note": filler})
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------------
# The broker side


class Topology:
    """A direct exchange with one durable queue bound to every event type."""

    def __init__(self, url: str) -> None:
        self.url = url
        tag = uuid.uuid4().hex[:8]
        self.exchange = f"bench-rabbitmq-{tag}"
        self.queue = f"bench-rabbitmq-{tag}"
        self.connection: aio_pika.abc.AbstractRobustConnection | None = None

    async def __aenter__(self) -> Topology:
        self.connection = await aio_pika.connect_robust(
            self.url, client_properties={"connection_name": f"bench-rabbitmq-setup {self.queue}"}
        )
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(self.exchange, "direct", durable=True)
        queue = await channel.declare_queue(self.queue, durable=True)
        for event_type in EVENT_TYPES:
            await queue.bind(exchange, event_type)
        await channel.close()
        return self

    async def purge(self) -> None:
        assert self.connection is not None
        channel = await self.connection.channel()
        queue = await channel.get_queue(self.queue, ensure=False)
        await queue.purge()
        await channel.close()

    async def count(self) -> int:
        assert self.connection is not None
        channel = await self.connection.channel()
        queue = await channel.declare_queue(self.queue, passive=True)
        await channel.close()
        return int(queue.declaration_result.message_count or 0)

    async def __aexit__(self, *exc: object) -> None:
        assert self.connection is not None
        channel = await self.connection.channel()
        await channel.queue_delete(self.queue)
        await channel.exchange_delete(self.exchange)
        await self.connection.close()


def outbox_messages(events: list[Event]) -> list[OutboxMessage]:
    """The events as claimed rows would hand them to the publisher (ids made up)."""
    return [
        OutboxMessage(
            id=i,
            aggregate_type="order",
            aggregate_id=aggregate_id,
            event_type=event_type,
            body=json.dumps(payload).encode(),
            attempt=1,
            lease_version=1,
            ordered=False,
        )
        for i, (aggregate_id, event_type, payload) in enumerate(events, start=1)
    ]


def envelopes_for(events: list[Event], settings: RabbitSettings) -> list[Envelope]:
    """The messages exactly as the relay builds them."""
    envelopes = []
    for m in outbox_messages(events):
        built = build(m, settings, 131072)
        assert isinstance(built, Envelope), built
        envelopes.append(built)
    return envelopes


async def adapter_run(settings: RabbitSettings, messages: list[OutboxMessage], workers: int, batch: int) -> float:
    """Seconds for the adapter alone (no database) to publish every message: ``workers``
    callers of ``RabbitPublisher.publish`` side by side, as the relay's workers call it."""
    publisher = RabbitPublisher(settings, connection_name="bench-rabbitmq-adapter")
    await publisher.start()
    try:
        chunks = [messages[i : i + batch] for i in range(0, len(messages), batch)]

        async def worker(w: int) -> None:
            for chunk in chunks[w::workers]:
                outcomes = await publisher.publish(chunk)
                if any(o is not None for o in outcomes):
                    raise SystemExit(f"adapter run failed: {next(o for o in outcomes if o is not None)}")

        started = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(workers)))
        return time.perf_counter() - started
    finally:
        await publisher.close()


def as_aio_pika(e: Envelope) -> aio_pika.Message:
    """The envelope's message as an aio-pika Message with the same body and properties."""
    p = e.properties
    return aio_pika.Message(
        e.body,
        headers=p.headers,
        content_type=p.content_type,
        delivery_mode=p.delivery_mode,
        message_id=p.message_id,
        type=p.message_type,
        timestamp=p.timestamp,
        app_id=p.app_id,
    )


async def raw_run(
    url: str, exchange_name: str, envelopes: list[Envelope], channels: int, batch: int, style: str
) -> float:
    """Seconds to publish every envelope with aio-pika alone: ``channels`` publishers side by
    side, each publishing a batch at once and awaiting its confirms together.

    ``style`` "exchange": aio-pika's ``Exchange.publish`` (which waits for each write to
    reach the socket); "nowait": aiormq's ``basic_publish(wait=False)`` under the same
    channel, the call the adapter makes.
    """
    connection = await aio_pika.connect_robust(url, client_properties={"connection_name": "bench-rabbitmq-raw"})
    try:
        chunks = [envelopes[i : i + batch] for i in range(0, len(envelopes), batch)]
        messages = {id(e): as_aio_pika(e) for e in envelopes}
        publishers = []
        for lane in range(channels):
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.get_exchange(exchange_name, ensure=False)
            underlay = cast(aiormq.Channel, await channel.get_underlay_channel())

            async def send(e: Envelope, exchange: Any = exchange, underlay: aiormq.Channel = underlay) -> Any:
                if style == "exchange":
                    return await exchange.publish(messages[id(e)], e.routing_key, mandatory=True)
                return await underlay.basic_publish(
                    e.body,
                    exchange=exchange_name,
                    routing_key=e.routing_key,
                    properties=e.properties,
                    mandatory=True,
                    wait=False,
                )

            async def publisher(lane: int = lane, send: Any = send) -> None:
                for chunk in chunks[lane::channels]:
                    await asyncio.gather(*(send(e) for e in chunk))

            publishers.append(publisher)

        started = time.perf_counter()
        await asyncio.gather(*(publisher() for publisher in publishers))
        return time.perf_counter() - started
    finally:
        await connection.close()


# ---------------------------------------------------------------------------------------
# The relay side


def relay_bin() -> list[str]:
    script = Path(sys.executable).with_name("relay")
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


async def seed_outbox(dsn: str, names: OutboxNames, events: list[Event], ordering: OrderingMap) -> None:
    """A fresh outbox holding ``events``, routed by ``ordering`` as the relay will be."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(names.schema)))
    migrate = [*relay_bin(), "migrate", "--dsn", dsn, "--schema", names.schema]
    await asyncio.to_thread(subprocess.run, migrate, check=True, capture_output=True)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await store_ordering(conn, names, ordering)
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        table = sql.Identifier(names.schema, names.table)
        copy = sql.SQL("COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN").format(table)
        with cur.copy(copy) as c:
            for aggregate_id, event_type, payload in events:
                c.write_row(("order", aggregate_id, event_type, json.dumps(payload)))
        conn.execute(sql.SQL("ANALYZE {}").format(table))


def cpu_note(
    seconds: float, n: int, sender: float, postgres: float, rabbit: float, machine: float, who: str = "relay"
) -> str:
    """Where the CPU went during a run: cores (CPU seconds per second of the run) and
    microseconds per message. "other" is the rest of the machine: anyone else's work.
    (A PostgreSQL backend that exits during the run takes its CPU time with it: postgres
    can then read low, or below zero.)"""
    rest = max(machine - sender - postgres - rabbit, 0.0)
    parts = [(who, sender), ("postgres", postgres), ("rabbitmq", rabbit), ("other", rest)]
    return "cpu " + ", ".join(f"{name} {used / seconds:.2f} ({used / n * 1e6:.0f} us/msg)" for name, used in parts)


def cpu_now() -> tuple[float, float, float, float]:
    """This process, PostgreSQL, RabbitMQ and the whole machine: CPU seconds so far."""
    return time.process_time(), command_cpu("postgres"), command_cpu("beam.smp"), machine_busy()[0]


def relay_run(
    args: argparse.Namespace,
    names: OutboxNames,
    exchange: str,
    n: int,
    ordered: bool,
    extra: tuple[str, ...] = (),
    binary: tuple[str, ...] = (),
    variables: tuple[tuple[str, str], ...] = (),
) -> tuple[float, str]:
    """Seconds from the first row leaving 'pending' to every row 'done', and where the CPU went."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(variables)
    log_path = Path(tempfile.gettempdir()) / "relay-bench-rabbitmq.log"
    command = [
        *(binary or relay_bin()), "start", "--dsn", args.dsn, "--schema", names.schema,
        "--broker", "rabbitmq", "--amqp-url", args.amqp_url, "--exchange", exchange,
        "--routing-key", "{event_type}",
        "--workers", str(args.workers), "--batch-size", str(args.batch_size), "--log-level", "warning",
        "--ordering-default", "ordered" if ordered else "unordered", *extra,
    ]  # fmt: skip
    table = sql.Identifier(names.schema, names.table)
    waiting = progress.waiting(table)  # polled every 10 ms
    dead_rows = sql.SQL("SELECT count(*) FROM {} WHERE status = 'dead'").format(table)
    moving = progress.moving(table)
    with log_path.open("w") as log, psycopg.connect(args.dsn, autocommit=True) as conn:
        relay = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
        dead = 0
        try:
            # The clock starts when the first claim commits, so the relay's start-up
            # (connecting to PostgreSQL and RabbitMQ) is not counted.
            while not _fetch(conn, moving)[0]:
                if relay.poll() is not None:
                    raise SystemExit(f"relay exited: {log_path.read_text()[-2000:]}")
                time.sleep(0.005)
            started = time.perf_counter()
            cpu0 = (process_cpu(relay.pid), command_cpu("postgres"), command_cpu("beam.smp"), machine_busy()[0])
            while _fetch(conn, waiting)[0]:
                if relay.poll() is not None:
                    raise SystemExit(f"relay exited: {log_path.read_text()[-2000:]}")
                time.sleep(0.01)
            took = time.perf_counter() - started
            cpu1 = (process_cpu(relay.pid), command_cpu("postgres"), command_cpu("beam.smp"), machine_busy()[0])
            (dead,) = _fetch(conn, dead_rows)
        finally:
            relay.send_signal(signal.SIGTERM)
            code = relay.wait(30)
    if dead or code != 0:
        raise SystemExit(f"relay run not clean: {dead} dead, exit code {code}; see {log_path}")
    relay_cpu, pg_cpu, rabbit_cpu, machine = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    return took, cpu_note(took, n, relay_cpu, pg_cpu, rabbit_cpu, machine)


def seed_reference(dsn: str, events: list[Event]) -> None:
    """A fresh reference table holding ``events`` (for the minimal relay)."""
    reset_base(dsn)
    table = sql.Identifier(BASE_SCHEMA, "outbox")
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        copy = sql.SQL("COPY {} (aggregate_type, aggregate_id, event_type, payload) FROM STDIN").format(table)
        with cur.copy(copy) as c:
            for aggregate_id, event_type, payload in events:
                c.write_row(("order", aggregate_id, event_type, json.dumps(payload)))
        conn.execute(sql.SQL("ANALYZE {}").format(table))


async def minimal_relay(args: argparse.Namespace, exchange: str, n: int, ordered: bool) -> tuple[float, str]:
    """The minimal relay on the reference table: claim, publish with confirms, one fenced
    finalize a batch, ``args.workers`` loops. Seconds to deliver all ``n``, and the CPU."""
    claim = base_sql(CEIL_CLAIM.replace("{ordered}", CEIL_HEAD if ordered else ""))
    finalize = base_sql(BASE_DONE_BATCH)
    connection = await aio_pika.connect(args.amqp_url, client_properties={"connection_name": "bench-minimal-relay"})
    delivered = 0

    async def loop(i: int) -> None:
        nonlocal delivered
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
        params = {"batch": args.batch_size, "owner": f"minimal:{i}", "lease": LEASE}
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            while delivered < n:
                cur = await conn.execute(claim, params)
                rows = await cur.fetchall()
                if not rows:
                    await asyncio.sleep(0.001)
                    continue
                sends = []
                for outbox_id, version, attempts, aggregate_id, event_type, payload in rows:
                    properties = aiormq.spec.Basic.Properties(
                        content_type="application/json",
                        delivery_mode=2,
                        message_id=str(outbox_id),
                        message_type=event_type,
                        headers={"outbox_id": outbox_id, "aggregate_id": aggregate_id, "event_type": event_type,
                                 "attempt": attempts, "lease_version": version},
                    )  # fmt: skip
                    body = json.dumps(payload).encode()
                    sends.append(
                        underlay.basic_publish(
                            body, exchange=exchange, routing_key=event_type, properties=properties, mandatory=True
                        )
                    )
                await asyncio.gather(*sends)
                await conn.execute(finalize, {"ids": [r[0] for r in rows], "versions": [r[1] for r in rows]})
                delivered += len(rows)

    try:
        before = cpu_now()
        started = time.perf_counter()
        await asyncio.gather(*(loop(i) for i in range(args.workers)))
        took = time.perf_counter() - started
        used = [b - a for a, b in zip(before, cpu_now(), strict=True)]
    finally:
        await connection.close()
    return took, cpu_note(took, n, *used, who="minimal relay")


def _fetch(conn: psycopg.Connection[Any], query: sql.Composed) -> tuple[Any, ...]:
    row = conn.execute(query).fetchone()
    assert row is not None
    return tuple(row)


# ---------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace) -> float:
    events = make_events(args.messages, args.aggregates, args.payload_bytes)
    names = OutboxNames(schema=f"bench_rabbitmq_{uuid.uuid4().hex[:8]}", table="outbox")
    ordering = OrderingMap(default_ordered=args.ordered)
    n = len(events)
    ratios, relay_rates, raw_rates = [], [], []
    minimal_rates: list[float] = []
    of_minimal: list[float] = []
    others: dict[str, list[tuple[float, float]]] = {}  # variant: (rate, ratio) per round
    async with Topology(args.amqp_url) as topology:
        settings = RabbitSettings(
            url=args.amqp_url, exchange=topology.exchange, routing_key=RoutingKeyTemplate("{event_type}")
        )
        envelopes = envelopes_for(events, settings)
        messages = outbox_messages(events)
        try:
            for round_no in range(1, args.rounds + 1):
                raw: dict[tuple[str, int], float] = {}
                raw_cpu: dict[tuple[str, int], str] = {}
                for style in RAW_STYLES:
                    for channels in RAW_CHANNELS:
                        await topology.purge()
                        before = cpu_now()
                        took = await raw_run(
                            args.amqp_url, topology.exchange, envelopes, channels, args.batch_size, style
                        )
                        used = [b - a for a, b in zip(before, cpu_now(), strict=True)]
                        raw_cpu[style, channels] = cpu_note(took, n, *used, who="raw client")
                        raw[style, channels] = n / took
                        assert await topology.count() == n, "raw run lost messages"
                best = max(raw, key=lambda k: raw[k])
                idiomatic = max(raw[k] for k in raw if k[0] == "exchange")
                await topology.purge()
                adapter_rate = n / await adapter_run(settings, messages, args.workers, args.batch_size)
                Variant = tuple[str, tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]
                variants: list[Variant] = [("relay", (), (), ())]
                if args.compare_unpipelined:
                    variants.append(("relay --no-pipeline", ("--no-pipeline",), (), ()))
                if args.compare_otel:
                    variants.append(("relay --otel", ("--otel",), (), (("OTEL_TRACES_EXPORTER", "none"),)))
                if args.baseline_relay:
                    variants.append(("baseline relay", (), (args.baseline_relay,), ()))
                notes = []
                for label, extra, binary, variables in variants:
                    await topology.purge()
                    await seed_outbox(args.dsn, names, events, ordering)
                    took, cpu = await asyncio.to_thread(
                        relay_run, args, names, topology.exchange, n, args.ordered, extra, binary, variables
                    )
                    delivered = await topology.count()
                    if delivered < n:
                        raise SystemExit(f"{label} run lost messages: {delivered} of {n} in the queue")
                    notes.append(f"{label} {n / took:,.0f} msg/s, ratio {n / took / raw[best]:.2f} ({cpu})")
                    others.setdefault(label, []).append((n / took, n / took / raw[best]))
                    if label == "relay":
                        relay_rate = n / took
                await topology.purge()
                await asyncio.to_thread(seed_reference, args.dsn, events)
                took, minimal_cpu = await minimal_relay(args, topology.exchange, n, args.ordered)
                delivered = await topology.count()
                if delivered < n:
                    raise SystemExit(f"minimal relay lost messages: {delivered} of {n} in the queue")
                minimal_rates.append(n / took)
                of_minimal.append(relay_rate / (n / took))
                notes.append(f"minimal relay {n / took:,.0f} msg/s, relay/minimal {of_minimal[-1]:.2f} ({minimal_cpu})")
                ratios.append(relay_rate / raw[best])
                relay_rates.append(relay_rate)
                raw_rates.append(raw[best])
                detail = ", ".join(f"{style} x{c} {r:,.0f}" for (style, c), r in raw.items())
                print(
                    f"round {round_no}: raw {raw[best]:,.0f} msg/s (best: {best[0]} on {best[1]} channels;"
                    f" all: {detail}); adapter without database {adapter_rate:,.0f} msg/s"
                    f" ({adapter_rate / raw[best]:.2f} of raw); relay {relay_rate:,.0f} msg/s"
                    f" ({args.workers} workers, batch {args.batch_size}); ratio {relay_rate / raw[best]:.2f}"
                    f" (vs Exchange.publish alone {relay_rate / idiomatic:.2f}); load average"
                    f" {os.getloadavg()[0]:.2f}\n    raw ({raw_cpu[best]})\n    " + "\n    ".join(notes),
                    flush=True,
                )
        finally:
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(names.schema)))
    print(
        f"median over {args.rounds} rounds, N={n:,} ({'ordered' if args.ordered else 'unordered'},"
        f" {args.payload_bytes}-byte payloads): raw {statistics.median(raw_rates):,.0f} msg/s,"
        f" relay {statistics.median(relay_rates):,.0f} msg/s, ratio {statistics.median(ratios):.2f}"
        f"; minimal relay {statistics.median(minimal_rates):,.0f} msg/s, relay/minimal"
        f" {statistics.median(of_minimal):.2f} (goal >= 0.90:"
        f" {'met' if statistics.median(of_minimal) >= 0.9 else 'MISSED'})"
    )
    for label, runs in others.items():
        if label != "relay":
            print(
                f"        {label} {statistics.median(r for r, _ in runs):,.0f} msg/s,"
                f" ratio {statistics.median(q for _, q in runs):.2f}"
            )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return statistics.median(of_minimal)


def add_outbox_arguments(p: argparse.ArgumentParser) -> None:
    """The services, the outbox's events and the relay's size: this script's and bench_replay's."""
    p.add_argument("--dsn", default=os.environ.get("RELAY_TEST_DSN", DEFAULT_DSN))
    p.add_argument("--amqp-url", default=os.environ.get("RELAY_TEST_AMQP_URL", DEFAULT_AMQP_URL))
    p.add_argument("--messages", "-n", type=int, default=20_000)
    p.add_argument("--aggregates", type=int, default=1_000)
    p.add_argument("--payload-bytes", type=int, default=200)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="relay end to end vs raw aio-pika with confirms, same RabbitMQ")
    add_outbox_arguments(p)
    p.add_argument("--ordered", action="store_true", help="route every event type through the ordered claim")
    p.add_argument(
        "--compare-unpipelined", action="store_true", help="also run the relay with --no-pipeline in every round"
    )
    p.add_argument(
        "--compare-otel",
        action="store_true",
        help="also run the relay with --otel (OTEL_TRACES_EXPORTER=none: spans made, none exported) in every round",
    )
    p.add_argument(
        "--baseline-relay",
        metavar="PATH",
        help="also run this `relay` executable (another checkout's, say) in every round, same outbox and queue",
    )
    args = p.parse_args(argv)
    print(f"python {platform.python_version()}, aio-pika {aio_pika.__version__}, {os.cpu_count()} CPUs", flush=True)
    ratio = asyncio.run(bench(args))
    return 0 if ratio >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
