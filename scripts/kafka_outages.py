"""The Kafka destination through its outages, measured: rows dead and delivered after the
topic is deleted mid-run, after the broker is SIGKILLed and restarted mid-run, and after
the broker is down for 60 s (issue 38, item 13). The broker is noida-db (a Kafka-protocol
broker from the package index, tests/kafka_broker.py), started here on a port and data
directory of its own; the figures come from the outbox rows and from the topic itself
(read back from the beginning), never from the relay's counters.

    python scripts/kafka_outages.py [--scenario deleted|restart|down] [--events 3000]
        [--aggregates 200] [--down 60] [--pythonpath DIR]

``--pythonpath DIR`` runs the relay from another copy of the ``relay`` package (a
``git archive`` of an older commit), to measure the code before a change beside it.
Every relay runs with ``--max-attempts 5 --backoff-cap 1s --publish-timeout 3s`` (the
issue's settings: a message charged for an outage goes dead within about 20 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kafka_broker import PERSIST_S, KafkaService, start_noida
from tests.pg_clusters import free_port

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "kafka_outages"
RELAY = str(Path(sys.executable).with_name("relay"))
HORIZON = ("--max-attempts", "5", "--backoff-cap", "1s", "--publish-timeout", "3s")
# How long each phase is watched: the "nothing delivered 60 s later".
WATCH_S = 60.0


class Outbox:
    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.table = sql.Identifier(SCHEMA, "outbox")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        subprocess.run(
            [RELAY, "migrate", "--dsn", dsn, "--schema", SCHEMA, "--ordering-default", "unordered",
             "--ordered", "Order*"],
            check=True, capture_output=True,
        )  # fmt: skip

    def insert(self, events: int, aggregates: int, first: int = 0) -> None:
        """Ordered events, interleaved across aggregates as concurrent orders write them."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', 'order-' || (g %% %s::int), 'OrderPlaced', jsonb_build_object('i', g)"
                    " FROM generate_series(%s::int, %s::int) AS g ORDER BY g"
                ).format(self.table),
                (aggregates, first, first + events - 1),
            )

    def statuses(self) -> Counter[str]:
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY status").format(self.table))
            return Counter(dict(rows.fetchall()))

    def spent(self) -> int:
        """Attempts spent by rows still waiting (pending): an outage should spend none."""
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT coalesce(sum(attempts), 0) FROM {} WHERE status = 'pending'").format(self.table)
            ).fetchone()
            return int(row[0]) if row else 0

    def event_ids(self) -> set[str]:
        with psycopg.connect(self.dsn) as conn:
            return {str(r[0]) for r in conn.execute(sql.SQL("SELECT event_id FROM {}").format(self.table))}


def log_path(topic: str) -> Path:
    """The relay's log of a scenario (kept, for a look after)."""
    return Path(tempfile.gettempdir()) / f"kafka-outages-relay-{topic}.log"


def relay(kafka: KafkaService, topic: str, dsn: str, pythonpath: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DSN=dsn, RELAY_LOG_LEVEL="warning")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.Popen(
        [RELAY, "start", "--schema", SCHEMA, "--broker", "kafka", "--bootstrap-servers", kafka.bootstrap,
         "--topic", topic, "--workers", "2", "--batch-size", "100", "--poll-interval", "100ms",
         "--backoff-base", "100ms", "--ordered", "Order*", *HORIZON],
        env=env, stdout=subprocess.DEVNULL, stderr=open(log_path(topic), "wb"),
    )  # fmt: skip


def wait_for(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def say(phase: str, outbox: Outbox, kafka: KafkaService, topic: str, extra: str = "") -> None:
    s = outbox.statuses()
    partitions = kafka.partitions(topic) if kafka.process.poll() is None else "?"
    print(
        f"  {phase}: done {s['done']}, dead {s['dead']}, waiting {s['pending'] + s['processing']},"
        f" attempts spent by waiting rows {outbox.spent()}, topic partitions {partitions}{extra}",
        flush=True,
    )


def topic_counts(kafka: KafkaService, topic: str, outbox: Outbox) -> str:
    counts = Counter(r.headers["event_id"] for r in kafka.read(topic))
    ours = outbox.event_ids()
    return (
        f"; topic holds {sum(counts.values())} records: {len(ours & set(counts))} of {len(ours)} events,"
        f" {sum(n - 1 for n in counts.values())} duplicates"
    )


def deleted(kafka: KafkaService, outbox: Outbox, args: argparse.Namespace) -> None:
    """The issue's scenario: the topic deleted once about 30% is delivered."""
    topic = kafka.create_topic(partitions=3)
    outbox.insert(args.events, args.aggregates)
    proc = relay(kafka, topic, args.dsn, args.pythonpath)
    try:
        wait_for(lambda: outbox.statuses()["done"] >= args.events * 3 // 10, 60)
        say("deleting the topic", outbox, kafka, topic)
        kafka.delete_topic(topic)
        say("topic deleted", outbox, kafka, topic)
        time.sleep(WATCH_S)
        say(f"{WATCH_S:.0f}s later", outbox, kafka, topic)
        if kafka.partitions(topic) is None:
            kafka.create_topic(partitions=3, name=topic)
            print("  topic created again (3 partitions)", flush=True)
        else:
            print("  the topic was already back: the relay created it", flush=True)
        wait_for(lambda: outbox.statuses()["done"] + outbox.statuses()["dead"] == args.events, WATCH_S)
        say(f"up to {WATCH_S:.0f}s after", outbox, kafka, topic, topic_counts(kafka, topic, outbox))
    finally:
        proc.kill()
        proc.wait()


def restart(kafka: KafkaService, outbox: Outbox, args: argparse.Namespace) -> None:
    """The broker SIGKILLed once about 30% is delivered, started again 4 s later."""
    topic = kafka.create_topic(partitions=3)
    time.sleep(PERSIST_S)
    outbox.insert(args.events, args.aggregates)
    proc = relay(kafka, topic, args.dsn, args.pythonpath)
    try:
        wait_for(lambda: outbox.statuses()["done"] >= args.events * 3 // 10, 60)
        say("killing the broker", outbox, kafka, topic)
        kafka.kill()
        say("broker killed", outbox, kafka, topic)
        time.sleep(4)
        kafka.restart()
        say("broker started again", outbox, kafka, topic)
        wait_for(lambda: outbox.statuses()["done"] + outbox.statuses()["dead"] == args.events, WATCH_S)
        say(f"up to {WATCH_S:.0f}s after", outbox, kafka, topic, topic_counts(kafka, topic, outbox))
    finally:
        proc.kill()
        proc.wait()


def down(kafka: KafkaService, outbox: Outbox, args: argparse.Namespace) -> None:
    """The issue's second scenario: the broker down for --down seconds while 50 events wait."""
    topic = kafka.create_topic(partitions=3)
    outbox.insert(10, 10)
    proc = relay(kafka, topic, args.dsn, args.pythonpath)
    try:
        wait_for(lambda: outbox.statuses()["done"] == 10, 60)
        time.sleep(PERSIST_S)  # the broker's disk has what it acknowledged: the kill loses nothing
        kafka.kill()
        outbox.insert(50, 25, first=10)
        say("broker killed, 50 events written", outbox, kafka, topic)
        time.sleep(args.down)
        say(f"{args.down:.0f}s down", outbox, kafka, topic)
        kafka.restart()
        wait_for(lambda: outbox.statuses()["done"] + outbox.statuses()["dead"] == 60, WATCH_S)
        say(f"up to {WATCH_S:.0f}s after the restart", outbox, kafka, topic, topic_counts(kafka, topic, outbox))
    finally:
        proc.kill()
        proc.wait()


SCENARIOS = {"deleted": deleted, "restart": restart, "down": down}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--aggregates", type=int, default=200)
    parser.add_argument("--down", type=float, default=60.0)
    parser.add_argument("--pythonpath", help="run the relay from this copy of the relay package")
    args = parser.parse_args()
    for name in args.scenario or sorted(SCENARIOS):
        data_dir = Path(tempfile.mkdtemp(prefix="kafka-outages-"))
        port = free_port()
        kafka = KafkaService(f"127.0.0.1:{port}", start_noida(port, data_dir), data_dir)
        print(f"{name} ({args.events} events over {args.aggregates} aggregates):" if name != "down" else name)
        try:
            SCENARIOS[name](kafka, Outbox(args.dsn), args)
        finally:
            kafka.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
            data_dir.with_name(f"{data_dir.name}.log").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
