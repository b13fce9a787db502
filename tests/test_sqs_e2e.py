"""``relay start --broker sqs`` as a real subprocess, against PostgreSQL and moto over HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from relay.adapters.sqs import SqsSettings
from relay.adapters.sqs.publisher import SqsPublisher
from relay.message import OutboxMessage
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.helpers import http_get
from tests.producers import (
    ORDERING,
    ORDERING_FLAGS,
    Arrival,
    order_violations,
    producers_both_ways,
    route_by,
    seed,
)
from tests.relay_process import RelayProcess, relay_env, run_relay, wait_until
from tests.sqs_server import queue_url, receive_all, unique_queue_name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def as_message(row: dict[str, Any]) -> OutboxMessage:
    return OutboxMessage(
        id=row["id"],
        aggregate_type=row["aggregate_type"],
        aggregate_id=row["aggregate_id"],
        event_type=row["event_type"],
        body=json.dumps(row["payload"]).encode(),
        attempt=1,
        lease_version=1,
        ordered=ORDERING.is_ordered(row["event_type"]),
        event_id=str(row["event_id"]),  # what the relay sends for this row
    )


async def deliver_without_finalizing(url: str, endpoint: str, rows: list[dict[str, Any]]) -> None:
    """What a relay that crashed after publishing and before finalizing leaves behind:
    these messages are in the queue and their rows are still pending in the outbox."""
    publisher = SqsPublisher(SqsSettings(queue_url=url, region="us-east-1", endpoint_url=endpoint))
    await publisher.start()
    try:
        for row in rows:  # one at a time, in id order, as the ordered claim would
            assert await publisher.publish([as_message(row)]) == [None]
    finally:
        await publisher.close()


def test_relay_with_three_workers_drains_1000_events_over_50_aggregates_into_a_fifo_queue(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    db: Db,
    make_queue: Any,
    moto_endpoint: str,
    sqs_client: Any,
) -> None:
    url = make_queue(fifo=True)
    asyncio.run(route_by(pg_dsn, db.names, ORDERING))
    rows = seed(db, aggregates=50, per_aggregate=20)
    assert sum(r["ordered"] for r in rows) == 700  # CustomerNotified and ReceiptEmailed are not
    assert len(rows) == 1000
    # The first two ordered events of ten orders were already delivered by a relay that
    # died before recording it: the relay sends them again and SQS must collapse them.
    by_aggregate: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if ORDERING.is_ordered(row["event_type"]):
            by_aggregate[row["aggregate_id"]].append(row)
    already = [r for agg in sorted(by_aggregate)[:10] for r in by_aggregate[agg][:2]]
    asyncio.run(deliver_without_finalizing(url, moto_endpoint, already))

    relay = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", "sqs", "--queue-url", url, "--endpoint-url", moto_endpoint, "--region", "us-east-1",
        "--workers", "3", "--poll-interval", "100ms", *ORDERING_FLAGS,
    )  # fmt: skip
    # Meanwhile, services that lock their aggregate before writing (the design reference's
    # pattern) and services that do not, on aggregates of their own.
    locked, unlocked, producing = producers_both_ways(
        pg_dsn,
        db.names,
        locked_aggregates=[f"acct-L{i}" for i in range(8)],
        unlocked_aggregates=[f"acct-U{i}" for i in range(5)],
        locked_tx=20,
        unlocked_rounds=20,
        seeds=(8, 9),
        producer_dsn=producer_dsn,
    )
    try:
        producing.join()
        total = len(db.rows())
        drained = wait_until(lambda: db.statuses() == {"done": total} or not relay.running(), timeout=120)
        assert drained and relay.running(), relay.stderr()[-3000:]
        assert relay.stop() == 0, relay.stderr()[-3000:]
    finally:
        relay.close()

    got = receive_all(sqs_client, url, idle_s=0.3)
    ids = [r.outbox_id for r in got]
    assert len(ids) == len(set(ids)) == total, "every outbox id exactly once: redeliveries collapsed"
    assert set(ids) == {r["id"] for r in db.rows()}
    seeded = {r["id"] for r in rows}
    per_group: dict[str, list[int]] = defaultdict(list)
    for r in got:
        assert r.system["MessageGroupId"] == r.attributes["aggregate_id"]
        if ORDERING.is_ordered(r.attributes["event_type"]) and r.outbox_id in seeded:
            per_group[r.system["MessageGroupId"]].append(r.outbox_id)
    assert len(per_group) == 50
    for group, sequence in per_group.items():
        assert sequence == sorted(sequence), f"order broken in group {group}"  # one writer: id order
    received = [Arrival(r.outbox_id, r.attributes["aggregate_id"]) for r in got]
    assert order_violations(locked.expected(), received) == []
    assert order_violations(unlocked.expected(), received) == []


def test_a_queue_created_after_the_relay_started_is_used_within_seconds(
    pg_dsn: str,
    relay_dsn: str,
    db: Db,
    moto_endpoint: str,
    sqs_client: Any,
    tmp_path: Path,
) -> None:
    name = unique_queue_name(fifo=True)
    url = queue_url(moto_endpoint, name)
    # Unordered events: this test times the outage's end, nothing about ordering.
    asyncio.run(route_by(pg_dsn, db.names, OrderingMap(default_ordered=False)))
    ids = db.insert([(f"order-{i % 5}", "CustomerNotified", {"i": i}) for i in range(20)])
    # Settings from each source: the queue from the TOML file, the endpoint and region
    # from RELAY_* variables, the database from flags.
    config = tmp_path / "relay.toml"
    config.write_text(f'[sqs]\nqueue_url = "{url}"\n')
    env = relay_env(RELAY_ENDPOINT_URL=moto_endpoint, RELAY_REGION="us-east-1")
    port = free_port()
    relay = RelayProcess(
        "start", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", "sqs", "--workers", "2", "--poll-interval", "100ms", "--ordering-default", "unordered",
        "--metrics-port", str(port), "--metrics-host", "127.0.0.1", env=env,
    )  # fmt: skip
    readyz = f"http://127.0.0.1:{port}/readyz"
    try:
        # The first outage line (a loaded machine may take seconds to start the relay),
        # then several outage rounds.
        assert wait_until(lambda: "is unavailable" in relay.stderr() or not relay.running(), timeout=20)
        time.sleep(2)
        assert relay.running(), relay.stderr()
        statuses = db.statuses()
        assert "done" not in statuses and "dead" not in statuses, statuses
        assert max(r["attempts"] for r in db.rows()) <= 1, "an outage must not spend attempts"
        outage_lines = [line for line in relay.stderr().splitlines() if "is unavailable" in line]
        assert len(outage_lines) == 1 and url in outage_lines[0], relay.stderr()
        # Not ready, for the start-up check's reason or the breaker's (both name the queue).
        status, body = http_get(readyz)
        assert status == 503 and url in body and "NonExistentQueue" in body, (status, body)
        checked = [line for line in relay.stderr().splitlines() if "relay.readiness:" in line]
        assert len(checked) == 1 and f"destination SQS queue {url} missing: " in checked[0], checked

        sqs_client.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})
        created = time.monotonic()
        assert wait_until(lambda: db.statuses() == {"done": 20}, timeout=15), db.statuses()
        took = time.monotonic() - created
        assert took < 8, f"took {took:.1f}s after the queue appeared"
        assert "delivery resumed" in relay.stderr()
        assert wait_until(lambda: http_get(readyz)[0] == 200, timeout=10), http_get(readyz)
        assert relay.stop() == 0, relay.stderr()[-3000:]
    finally:
        relay.close()
    assert sorted(r.outbox_id for r in receive_all(sqs_client, url)) == ids


def test_start_without_a_queue_url_exits_2_with_one_line(pg_dsn: str) -> None:
    done = run_relay("start", "--dsn", pg_dsn, "--broker", "sqs")
    assert done.returncode == 2
    assert done.stderr.startswith("relay: no SQS queue: pass --queue-url"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
