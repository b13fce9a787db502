"""What the Python API costs next to writing the SQL by hand, same driver, same run.

Producers: ``relay.Outbox.add`` on a psycopg connection against a raw ``INSERT`` of the
same event from the same driver (the event id left to the database's default), one event
per transaction, 1, 4 and 16 producer processes; variants alternate within every round and
the median of the rounds is printed, with the ratio (API / raw; the goal is at least 0.95).

Consumers: ``relay.Inbox.receive`` inside the consumer's transaction against the same
transaction without it (the effect alone: one INSERT), on one connection; the time per
message of each and what the inbox adds.

    .venv/bin/python scripts/bench_api.py            # about 2 minutes
    .venv/bin/python scripts/bench_api.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay import Event, Inbox, Outbox, Received
from relay.db.names import OutboxNames
from relay.db.statements import schema_sql

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_api"
PAYLOAD = {"order_id": 42, "amount": "19.90", "currency": "EUR", "note": "x" * 32}
RAW = sql.SQL("INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES (%s, %s, %s, %s)").format(
    sql.Identifier(SCHEMA, "outbox")
)


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        conn.execute(OutboxNames(SCHEMA).render(schema_sql()))
        conn.execute("CHECKPOINT")


def _producer(dsn: str, variant: str, seconds: float, seed: int, out: Any) -> None:
    outbox = Outbox("outbox", SCHEMA)
    done = 0
    with psycopg.connect(dsn) as conn:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            aggregate = f"order-{(seed * 7919 + done) % 1000}"
            if variant == "api":
                outbox.add(conn, Event("order", aggregate, "OrderPaid", PAYLOAD))
            else:
                conn.execute(RAW, ("order", aggregate, "OrderPaid", json.dumps(PAYLOAD)))
            conn.commit()
            done += 1
    out.put(done)


def producers(dsn: str, variant: str, clients: int, seconds: float) -> float:
    """Events per second of ``clients`` producer processes running ``variant``."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_producer, args=(dsn, variant, seconds, i, queue)) for i in range(clients)]
    for p in procs:
        p.start()
    total = sum(queue.get() for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def consumer(dsn: str, with_inbox: bool, messages: int) -> float:
    """Microseconds per received message: one transaction each, the effect (one INSERT),
    and with the inbox its receive call first."""
    inbox = Inbox("inbox", SCHEMA)
    effect = sql.SQL("INSERT INTO {} (event_id, amount) VALUES (%s, %s)").format(sql.Identifier(SCHEMA, "effects"))
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        for n in range(messages):
            received = Received(
                event_id=uuid.uuid4(),
                aggregate_type="order",
                aggregate_id=f"order-{n % 1000}",
                event_type="OrderPaid",
                body=b"{}",
                aggregate_seq=n // 1000 + 1,
                aggregate_epoch="1.1.bench000",
            )
            if not with_inbox or inbox.receive(conn, received):
                conn.execute(effect, (received.event_id, 19.9))
            conn.commit()
        return (time.perf_counter() - start) / messages * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.seconds, args.rounds, args.messages = 1.5, 1, 1000
    setup(args.dsn)
    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for n in args.producers:
            # Which goes first alternates: the table and the WAL grow as a run goes on.
            for variant in ("raw", "api") if r % 2 == 0 else ("api", "raw"):
                rates.setdefault((variant, n), []).append(producers(args.dsn, variant, n, args.seconds))
    print("Producers: single-event transactions per second (median of rounds), psycopg 3")
    print("| producers | raw INSERT | relay.Outbox.add | ratio |\n|---|---|---|---|")
    for n in args.producers:
        raw, api = statistics.median(rates[("raw", n)]), statistics.median(rates[("api", n)])
        print(f"| {n} | {raw:,.0f}/s | {api:,.0f}/s | {api / raw:.2f} |")

    with psycopg.connect(args.dsn) as conn:
        Inbox("inbox", SCHEMA).migrate(conn)
        conn.execute(
            sql.SQL("CREATE TABLE {} (event_id uuid, amount numeric)").format(sql.Identifier(SCHEMA, "effects"))
        )
        conn.commit()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for with_inbox in (False, True):
            times[with_inbox].append(consumer(args.dsn, with_inbox, args.messages))
    bare, inboxed = statistics.median(times[False]), statistics.median(times[True])
    print("\nConsumers: one transaction per message, the effect one INSERT (median of rounds)")
    print("| consumer transaction | per message | |\n|---|---|---|")
    print(f"| the effect alone | {bare:,.0f} µs | |")
    print(f"| `Inbox.receive` + the effect | {inboxed:,.0f} µs | +{inboxed - bare:,.0f} µs ({inboxed / bare:.2f}x) |")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(SCHEMA)))


if __name__ == "__main__":
    main()
