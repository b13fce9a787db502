"""``relay start --broker sqs`` and ``--broker sns`` as real subprocesses, against PostgreSQL
and moto over HTTP: each case runs for both (``aws_kind``, tests/aws_destinations.py).

What a topic delivered is read from an SQS queue subscribed to it with raw message
delivery (:func:`tests.sns_server.make_topic`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from relay.message import OutboxMessage
from relay.ordering import OrderingMap
from tests.aws_destinations import SNS, SQS, AwsKind, AwsWorld
from tests.conftest import Db
from tests.helpers import http_get
from tests.pg_clusters import free_port
from tests.producers import (
    ORDERING,
    ORDERING_FLAGS,
    Arrival,
    order_violations,
    producers_both_ways,
    route_by,
    seed,
)
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until
from tests.sqs_server import receive_all


def as_message(row: dict[str, Any], seq: int) -> OutboxMessage:
    """The message a relay sends for ``row``, the ``seq``-th ordered event of its aggregate."""
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
        aggregate_seq=seq,
    )


async def deliver_without_finalizing(aws: AwsWorld, address: str, rows: list[dict[str, Any]]) -> None:
    """What a relay that crashed after publishing and before finalizing leaves behind:
    these messages were delivered and their rows are still pending in the outbox. ``rows``
    are the first ordered events of their aggregates, in id order."""
    publisher = await aws.publisher(address)
    seqs: dict[str, int] = defaultdict(int)
    for row in rows:  # one at a time, in id order, as the ordered claim would
        seqs[row["aggregate_id"]] += 1
        assert await publisher.publish([as_message(row, seqs[row["aggregate_id"]])]) == [None]


@dataclass(frozen=True)
class Drain:
    """How much each destination's drain test moves (SNS's fan-out to its queue costs moto
    more per message, so it moves less)."""

    aggregates: int
    per_aggregate: int
    locked: int  # aggregates of the producers that lock theirs
    unlocked: int
    transactions: int  # each locking producer's, and the others' rounds
    seeds: tuple[int, int]
    region_flags: tuple[str, ...] = ()  # SNS reads the region from the ARN


@pytest.mark.parametrize(
    ("aws_kind", "size"),
    [
        pytest.param(
            SQS,
            Drain(50, 20, locked=8, unlocked=5, transactions=20, seeds=(8, 9), region_flags=("--region", "us-east-1")),
            id="sqs",
        ),
        # SNS in make test-all: make test keeps SQS within its time.
        pytest.param(
            SNS,
            Drain(30, 10, locked=6, unlocked=4, transactions=15, seeds=(12, 13)),
            id="sns",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_relay_with_three_workers_drains_ordered_aggregates_into_a_fifo_destination_in_commit_order(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    db: Db,
    aws: AwsWorld,
    sqs_client: Any,
    size: Drain,
) -> None:
    destination = aws.make(fifo=True)
    asyncio.run(route_by(pg_dsn, db.names, ORDERING))
    rows = seed(db, aggregates=size.aggregates, per_aggregate=size.per_aggregate)
    assert len(rows) == size.aggregates * size.per_aggregate
    assert sum(r["ordered"] for r in rows) == len(rows) * 7 // 10  # CustomerNotified and ReceiptEmailed are not
    # The first two ordered events of ten orders were already delivered by a relay that
    # died before recording it: the relay sends them again and the FIFO queue must collapse them.
    by_aggregate: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if ORDERING.is_ordered(row["event_type"]):
            by_aggregate[row["aggregate_id"]].append(row)
    already = [r for agg in sorted(by_aggregate)[:10] for r in by_aggregate[agg][:2]]
    asyncio.run(deliver_without_finalizing(aws, destination.address, already))

    relay = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", aws.kind.broker, aws.kind.flag, destination.address, "--endpoint-url", aws.endpoint,
        *size.region_flags, "--workers", "3", "--poll-interval", "100ms", *ORDERING_FLAGS,
    )  # fmt: skip
    # Meanwhile, services that lock their aggregate before writing (the design reference's
    # pattern) and services that do not, on aggregates of their own.
    locked, unlocked, producing = producers_both_ways(
        pg_dsn,
        db.names,
        locked_aggregates=[f"acct-L{i}" for i in range(size.locked)],
        unlocked_aggregates=[f"acct-U{i}" for i in range(size.unlocked)],
        locked_tx=size.transactions,
        unlocked_rounds=size.transactions,
        seeds=size.seeds,
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

    got = receive_all(sqs_client, destination.inbox, idle_s=0.3)
    ids = [r.outbox_id for r in got]
    assert len(ids) == len(set(ids)) == total, "every outbox id exactly once: redeliveries collapsed"
    assert set(ids) == {r["id"] for r in db.rows()}
    seeded = {r["id"] for r in rows}
    per_group: dict[str, list[int]] = defaultdict(list)
    for r in got:
        assert r.system["MessageGroupId"] == r.attributes["aggregate_id"]
        assert r.system["MessageDeduplicationId"] == r.attributes.get("event_id", str(r.outbox_id))
        if ORDERING.is_ordered(r.attributes["event_type"]) and r.outbox_id in seeded:
            per_group[r.system["MessageGroupId"]].append(r.outbox_id)
            assert "aggregate_seq" in r.attributes
    assert len(per_group) == size.aggregates
    for group, sequence in per_group.items():
        assert sequence == sorted(sequence), f"order broken in group {group}"  # one writer: id order
    received = [Arrival(r.outbox_id, r.attributes["aggregate_id"]) for r in got]
    assert order_violations(locked.expected(), received) == []
    assert order_violations(unlocked.expected(), received) == []


@pytest.mark.parametrize(
    ("aws_kind", "fifo", "region_in_file"),
    # SNS in make test-all: make test keeps SQS within its time.
    [pytest.param(SQS, True, False, id="sqs"), pytest.param(SNS, False, True, id="sns", marks=pytest.mark.extended)],
)
def test_a_destination_created_after_the_relay_started_is_used_within_seconds(
    pg_dsn: str,
    relay_dsn: str,
    db: Db,
    aws: AwsWorld,
    sqs_client: Any,
    tmp_path: Path,
    fifo: bool,
    region_in_file: bool,
) -> None:
    k = aws.kind
    name, address = aws.absent(fifo=fifo)
    # Unordered events: this test times the outage's end, nothing about ordering.
    asyncio.run(route_by(pg_dsn, db.names, OrderingMap(default_ordered=False)))
    ids = db.insert([(f"order-{i % 5}", "CustomerNotified", {"i": i}) for i in range(20)])
    # Settings from each source: the destination from the TOML file's table, the endpoint
    # from a RELAY_* variable, the region from one or the other, the database from flags.
    config = tmp_path / "relay.toml"
    region = 'region = "us-east-1"\n' if region_in_file else ""
    config.write_text(f'[{k.broker}]\n{k.address} = "{address}"\n{region}')
    env = relay_env(RELAY_ENDPOINT_URL=aws.endpoint, **({} if region_in_file else {"RELAY_REGION": "us-east-1"}))
    port = free_port()
    relay = RelayProcess(
        "start", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", k.broker, "--workers", "2", "--poll-interval", "100ms", "--ordering-default", "unordered",
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
        assert len(outage_lines) == 1 and address in outage_lines[0] and k.missing in outage_lines[0], relay.stderr()
        # Not ready, for the start-up check's reason or the breaker's (both name the destination).
        status, body = http_get(readyz)
        assert status == 503 and address in body and k.missing in body, (status, body)
        checked = [line for line in relay.stderr().splitlines() if "relay.readiness:" in line]
        assert len(checked) == 1 and f"destination {k.destination} {address} missing: " in checked[0], checked

        created = aws.create(name)
        since = time.monotonic()
        assert wait_until(lambda: db.statuses() == {"done": 20}, timeout=15), db.statuses()
        took = time.monotonic() - since
        assert took < 8, f"took {took:.1f}s after the {k.noun} appeared"
        assert "delivery resumed" in relay.stderr()
        assert wait_until(lambda: http_get(readyz)[0] == 200, timeout=10), http_get(readyz)
        assert relay.stop() == 0, relay.stderr()[-3000:]
    finally:
        relay.close()
    assert sorted(r.outbox_id for r in receive_all(sqs_client, created.inbox)) == ids


def test_start_without_a_destination_exits_2_with_one_line(pg_dsn: str, aws_kind: AwsKind) -> None:
    done = run_relay("start", "--dsn", pg_dsn, "--broker", aws_kind.broker)
    line = assert_one_line_error(done, f"no {aws_kind.destination}: pass {aws_kind.flag}")
    assert line.startswith(f"relay: no {aws_kind.destination}: pass {aws_kind.flag}"), line


def test_start_with_a_region_in_both_aws_tables_exits_2_with_one_line(
    pg_dsn: str, tmp_path: Path, aws_kind: AwsKind
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('[sqs]\nregion = "eu-west-1"\n[sns]\nregion = "us-east-1"\n')
    done = run_relay("start", "--config", str(config), "--dsn", pg_dsn, "--broker", aws_kind.broker)
    assert_one_line_error(done, "region in both [sqs] and [sns]")
