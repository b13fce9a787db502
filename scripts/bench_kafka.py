"""The Kafka destination's throughput: `relay start --broker kafka` into a local Kafka-
protocol broker (noida-db, started here) against a raw aiokafka idempotent producer
(acks=all) publishing the same messages, same run, as a ratio; and each sender's CPU per
message.

The raw producer sends what the relay sends per batch: 4 tasks (the relay's 4 workers),
each queueing 100 records (the relay's batch size) with the same key, value and headers,
then awaiting all their acknowledgements before the next 100. The relay's rate counts from
its first record to its N-th (read from the topic's end offsets), so its start-up is left
out; its CPU is its process's over the same span.

    python scripts/bench_kafka.py [--messages 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.bench_http import (
    DEFAULT_DSN,
    PAYLOAD,
    RELAY,
    SCHEMA,
    SERVER_PIDS,
    Result,
    Span,
    alternate,
    free_port,
    log_run,
    report,
    setup,
    timed,
)
from scripts.procstat import pids_named

NOIDA = str(Path(sys.executable).with_name("noida-db"))
PARTITIONS = 4


async def _admin(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)])
    finally:
        await admin.close()


async def _count(bootstrap: str, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def count(bootstrap: str, topic: str) -> int:
    return asyncio.run(_count(bootstrap, topic))


def relay_run(dsn: str, bootstrap: str, messages: int) -> Result:
    topic = f"bench-{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(bootstrap, topic))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(RELAY_DSN=dsn, RELAY_LOG_LEVEL="warning")
    proc = subprocess.Popen(
        [RELAY, "start", "--schema", SCHEMA, "--broker", "kafka", "--bootstrap-servers", bootstrap,
         "--topic", topic, "--workers", "4", "--batch-size", "100", "--poll-interval", "50ms"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        seen = lambda: count(bootstrap, topic)  # noqa: E731
        return timed(proc.pid, messages, lambda: seen() > 0, lambda: seen() >= messages, 0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def raw_run(bootstrap: str, messages: int) -> Result:
    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    await _admin(bootstrap, topic)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    body = PAYLOAD.encode()
    per_task = messages // 4
    span = Span(os.getpid())

    async def task(t: int) -> None:
        for start in range(0, per_task, 100):
            futures = []
            for i in range(start, min(start + 100, per_task)):
                n = t * per_task + i
                headers = [("outbox_id", str(n).encode()), ("event_id", str(uuid.uuid4()).encode()),
                           ("aggregate_type", b"order"), ("aggregate_id", f"order-{n % 1000}".encode()),
                           ("event_type", b"OrderPaid"), ("attempt", b"1"), ("lease_version", b"1")]  # fmt: skip
                futures.append(await producer.send(topic, body, key=f"order-{n % 1000}".encode(), headers=headers))
            await asyncio.gather(*futures)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(task(t) for t in range(4)))
        elapsed = time.perf_counter() - started
    finally:
        await producer.stop()
    return span.result(per_task * 4, elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.messages, args.rounds = 4000, 1
    data = Path(tempfile.mkdtemp(prefix="bench-noida-"))
    port = free_port()
    # Its own session: the noida-db script is a wrapper whose child, the broker, a SIGTERM
    # to the wrapper alone would leave running.
    broker = subprocess.Popen(
        [NOIDA, "start", "--only", "kafka", "--kafka-port", str(port), "--data-dir", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    bootstrap = f"127.0.0.1:{port}"
    try:
        time.sleep(2)
        SERVER_PIDS[:] = pids_named("noida-db")  # the broker and the wrapper that started it

        def relay() -> Result:
            setup(args.dsn, args.messages)
            return relay_run(args.dsn, bootstrap, args.messages)

        def log() -> Result:
            setup(args.dsn, args.messages)
            return log_run(args.dsn, args.messages)

        raw = lambda: asyncio.run(raw_run(bootstrap, args.messages))  # noqa: E731
        results = alternate(args.rounds, {"relay": relay, "raw": raw, "log": log})
    finally:
        os.killpg(broker.pid, signal.SIGTERM)
        broker.wait()
        shutil.rmtree(data, ignore_errors=True)
    report(
        f"Kafka (noida-db): {args.messages:,} messages, median of {args.rounds} rounds",
        {
            "raw": "raw aiokafka idempotent producer",
            "relay": "relay start --broker kafka",
            "log": "relay start --broker log",
        },
        results,
    )


if __name__ == "__main__":
    main()
