"""Claim-check (relay.claimcheck): what a very large payload costs in memory, and what
storing payloads costs in throughput, against an embedded SQS and S3 (moto's server, a
process of its own).

    .venv/bin/python scripts/bench_claimcheck.py                  # 100 MB, then 1 MB vs 200 KB
    .venv/bin/python scripts/bench_claimcheck.py --large-mb 20 --messages 50   # a smoke run

- memory: one event with a ``--large-mb`` payload. `relay start --broker sqs
  --claim-check-bucket` stores and sends it; its peak RSS is read from /proc while it
  does. Then a consumer process (relay.Consumer with a PayloadFetcher, the documented
  handler reading ``event.open_payload()`` in 1 MiB chunks) applies it; its peak RSS too.
  Each against its own RSS idle before the event.
- throughput: ``--messages`` events of 1 MB through the claim-check against the same number
  of 200 KB events sent plainly (under SQS's 256 KiB), each drained by a relay from a fresh
  outbox: messages a second, from the first row leaving 'pending' to the last 'done'.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import boto3
import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.db.names import OutboxNames
from relay.db.statements import schema_sql
from scripts.bench_sqs import EmbeddedSqs
from scripts.procstat import rss_mb

RELAY = str(Path(sys.executable).with_name("relay"))
DEFAULT_DSN = os.environ.get("RELAY_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class Peak:
    """The peak RSS of ``pid``, sampled every 20 ms until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_mb(self.pid))
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.02)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak


def outbox(dsn: str) -> OutboxNames:
    names = OutboxNames(schema=f"bench_cc_{uuid.uuid4().hex[:8]}", table="outbox")
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
        conn.execute(names.render(schema_sql()))
    return names


def drop(dsn: str, names: OutboxNames) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(names.schema)))


def insert(dsn: str, names: OutboxNames, count: int, size: int) -> None:
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'doc', 'doc-' || i, 'DocumentStored', jsonb_build_object('i', i, 'blob', repeat('x', %s))"
                " FROM generate_series(1, %s) AS i"
            ).format(table),
            (size, count),
        )


def done(dsn: str, names: OutboxNames) -> tuple[int, float | None]:
    """Rows done, and the seconds from the first claim to the last done (None until all are)."""
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL(
                "SELECT count(*) FILTER (WHERE status = 'done'), count(*),"
                " extract(epoch FROM max(done_at) - min(done_at))"
                " FROM {}"
            ).format(table)
        ).fetchone()
    assert row is not None
    n_done, total, span = row
    return int(n_done), (float(span) if n_done == total and span is not None else None)


def start_relay(dsn: str, names: OutboxNames, endpoint: str, queue: str, bucket: str | None) -> subprocess.Popen[bytes]:
    args = [
        RELAY, "start", "--dsn", dsn, "--schema", names.schema, "--broker", "sqs", "--queue-url", queue,
        "--endpoint-url", endpoint, "--region", "us-east-1", "--poll-interval", "100ms", "--log-level", "warning",
    ]  # fmt: skip
    if bucket is not None:
        args += ["--claim-check-bucket", bucket, "--claim-check-endpoint-url", endpoint]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}, **AWS_ENV}
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()


CONSUMER = textwrap.dedent(
    """
    import asyncio, hashlib, sys, boto3, psycopg
    from psycopg_pool import AsyncConnectionPool
    from relay import Consumer, Inbox, PayloadFetcher, received_from_sqs

    dsn, endpoint, queue = sys.argv[1:4]

    async def handler(conn, event):
        sha = hashlib.sha256()
        with event.open_payload() as fh:
            while chunk := fh.read(1024 * 1024):
                sha.update(chunk)
        print("applied", event.event_id, sha.hexdigest()[:12], flush=True)

    async def main():
        with psycopg.connect(dsn) as conn:
            Inbox().migrate(conn)
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        print("ready", flush=True)
        sys.stdin.readline()
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
            consumer = Consumer(pool, Inbox(), handler, claim_check=PayloadFetcher(s3))
            answer = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=1, MessageAttributeNames=["All"])
            for message in answer.get("Messages", []):
                print("verdict", await consumer.apply(received_from_sqs(message)), flush=True)

    asyncio.run(main())
    """
)


def memory(args: argparse.Namespace, endpoint: str) -> None:
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    queue = sqs.create_queue(QueueName=f"bench-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    names = outbox(args.dsn)
    consumer_db = f"bench_cc_consumer_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(consumer_db)))
    consumer_dsn = psycopg.conninfo.make_conninfo(args.dsn, dbname=consumer_db)
    try:
        relay = start_relay(args.dsn, names, endpoint, queue, bucket)
        time.sleep(3)
        relay_idle = rss_mb(relay.pid)
        peak = Peak(relay.pid)
        insert(args.dsn, names, 1, args.large_mb * 1_000_000)
        began = time.monotonic()
        while done(args.dsn, names)[0] < 1 and time.monotonic() - began < 300:
            time.sleep(0.2)
        relay_s = time.monotonic() - began
        relay_peak = peak.stop()
        stop(relay)
        env = {**os.environ, **AWS_ENV}
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
            fh.write(CONSUMER)
        consumer = subprocess.Popen(
            [sys.executable, fh.name, consumer_dsn, endpoint, queue],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert consumer.stdout is not None and consumer.stdin is not None
        assert consumer.stdout.readline().strip() == "ready"
        consumer_idle = rss_mb(consumer.pid)
        cpeak = Peak(consumer.pid)
        began = time.monotonic()
        consumer.stdin.write("go\n")
        consumer.stdin.flush()
        out, _ = consumer.communicate(timeout=600)
        consumer_s = time.monotonic() - began
        consumer_peak = cpeak.stop()
        Path(fh.name).unlink()
    finally:
        drop(args.dsn, names)
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(consumer_db)))
    applied = "APPLIED" in out
    print(f"memory: one event with a {args.large_mb} MB payload through the claim-check")
    print(f"  relay:    RSS {relay_idle:.0f} MB idle, peak {relay_peak:.0f} MB ({relay_s:.1f} s to store and send)")
    print(
        f"  consumer: RSS {consumer_idle:.0f} MB before, peak {consumer_peak:.0f} MB"
        f" ({consumer_s:.1f} s to fetch, check and read; {'applied' if applied else 'NOT applied: ' + out[-200:]})"
    )


def throughput(args: argparse.Namespace, endpoint: str) -> None:
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    results = {}
    for label, size, use in (("1 MB, claim-check", 1_000_000, bucket), ("200 KB, plain", 200_000, None)):
        queue = sqs.create_queue(QueueName=f"bench-{uuid.uuid4().hex[:8]}")["QueueUrl"]
        names = outbox(args.dsn)
        try:
            insert(args.dsn, names, args.messages, size)
            relay = start_relay(args.dsn, names, endpoint, queue, use)
            began = time.monotonic()
            span = None
            while span is None and time.monotonic() - began < 600:
                time.sleep(0.5)
                span = done(args.dsn, names)[1]
            stop(relay)
            results[label] = args.messages / span if span else 0.0
        finally:
            drop(args.dsn, names)
    print(f"throughput: {args.messages} events a leg, one relay (4 workers), moto SQS and S3")
    for label, rate in results.items():
        print(f"  {label:<20} {rate:8.1f} msg/s")
    plain = results["200 KB, plain"]
    if plain:
        print(f"  claim-check 1 MB / plain 200 KB: {results['1 MB, claim-check'] / plain:.2f}x")


class _Instant:
    """A store that deletes at once (the sweep's own cost is what is measured)."""

    async def delete(self, refs: list[str]) -> tuple[list[str], None]:
        return list(refs), None


def sweep(args: argparse.Namespace) -> None:
    """What prune's sweep of <table>_payloads costs with --sweep-rows stored objects: all
    their rows in history (nothing to delete: every page read, none forgotten), then all
    rows gone (every object deleted and forgotten)."""
    import asyncio

    from relay.retention import _forget_payloads

    n = args.sweep_rows
    names = OutboxNames(f"bench_cc_{uuid.uuid4().hex[:8]}", "outbox")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
        conn.execute(names.render(schema_sql()))
        outbox, payloads = sql.Identifier(names.schema, "outbox"), sql.Identifier(names.schema, "outbox_payloads")
        conn.execute("SET session_replication_role = replica")
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, done_at, xid)"
                " SELECT 'doc', 'd-' || g, 'DocumentStored', '{{}}', 'done', now(), '1'"
                " FROM generate_series(1, %s) AS g"
            ).format(outbox),
            (n,),
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (ref, outbox_id) SELECT 's3://b/outbox-relay/' || o.event_id, o.id FROM {} o"
            ).format(payloads, outbox)
        )
        conn.execute(sql.SQL("ANALYZE {}").format(outbox))
        conn.execute(sql.SQL("ANALYZE {}").format(payloads))

    async def run() -> tuple[float, float, object, object]:
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            started = time.perf_counter()
            kept = await _forget_payloads(conn, names, _Instant(), 5000, dry_run=False)
            in_history = time.perf_counter() - started
            await conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(names.schema, "outbox")))
            started = time.perf_counter()
            gone = await _forget_payloads(conn, names, _Instant(), 5000, dry_run=False)
            return in_history, time.perf_counter() - started, kept, gone

    try:
        in_history, all_gone, kept, gone = asyncio.run(run())
    finally:
        drop(args.dsn, names)
    print(f"prune's sweep of {n:,} stored objects (pages of 5,000)")
    print(f"  rows all in history: {in_history:6.2f} s, deleted {kept}")
    print(f"  rows all gone:       {all_gone:6.2f} s, {gone}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--large-mb", type=int, default=100)
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--sweep-rows", type=int, default=1_000_000)
    parser.add_argument("--only", choices=("memory", "throughput", "sweep"))
    args = parser.parse_args()
    if args.only == "sweep":
        sweep(args)
        return
    os.environ.update(AWS_ENV)
    server = EmbeddedSqs()
    try:
        if args.only in (None, "memory"):
            memory(args, server.endpoint)
        if args.only in (None, "throughput"):
            throughput(args, server.endpoint)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
