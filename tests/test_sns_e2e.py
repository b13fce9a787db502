"""``relay start --broker sns`` as a real subprocess, against PostgreSQL and moto over HTTP.

What the topic delivered is read from an SQS queue subscribed to it with raw message
delivery (:func:`tests.sns_server.make_topic`).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from relay.ordering import OrderingMap
from tests.conftest import Db
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
from tests.sns_server import Topic, create_topic, subscribe_queue, topic_arn, unique_topic_name
from tests.sqs_server import receive_all


def test_relay_with_three_workers_drains_ordered_aggregates_into_a_fifo_topic_in_commit_order(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    db: Db,
    make_topic: Any,
    moto_endpoint: str,
    sqs_client: Any,
) -> None:
    topic: Topic = make_topic(fifo=True)
    asyncio.run(route_by(pg_dsn, db.names, ORDERING))
    rows = seed(db, aggregates=30, per_aggregate=10)
    assert len(rows) == 300 and sum(r["ordered"] for r in rows) == 210

    relay = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", "sns", "--topic-arn", topic.arn, "--endpoint-url", moto_endpoint,
        "--workers", "3", "--poll-interval", "100ms", *ORDERING_FLAGS,
    )  # fmt: skip
    # Meanwhile, services that lock their aggregate before writing (the design reference's
    # pattern) and services that do not, on aggregates of their own.
    locked, unlocked, producing = producers_both_ways(
        pg_dsn,
        db.names,
        locked_aggregates=[f"acct-L{i}" for i in range(6)],
        unlocked_aggregates=[f"acct-U{i}" for i in range(4)],
        locked_tx=15,
        unlocked_rounds=15,
        seeds=(12, 13),
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

    got = receive_all(sqs_client, topic.queue_url, idle_s=0.3)
    ids = [r.outbox_id for r in got]
    assert len(ids) == len(set(ids)) == total, "every outbox id exactly once"
    assert set(ids) == {r["id"] for r in db.rows()}
    seeded = {r["id"] for r in rows}
    per_group: dict[str, list[int]] = defaultdict(list)
    for r in got:
        assert r.system["MessageGroupId"] == r.attributes["aggregate_id"]
        assert r.system["MessageDeduplicationId"] == r.attributes.get("event_id", str(r.outbox_id))
        if r.attributes["event_type"].startswith("Order") and r.outbox_id in seeded:
            per_group[r.system["MessageGroupId"]].append(r.outbox_id)
            assert "aggregate_seq" in r.attributes
    assert len(per_group) == 30
    for group, sequence in per_group.items():
        assert sequence == sorted(sequence), f"order broken in group {group}"  # one writer: id order
    received = [Arrival(r.outbox_id, r.attributes["aggregate_id"]) for r in got]
    assert order_violations(locked.expected(), received) == []
    assert order_violations(unlocked.expected(), received) == []


def test_a_topic_created_after_the_relay_started_is_used_within_seconds(
    pg_dsn: str,
    relay_dsn: str,
    db: Db,
    moto_endpoint: str,
    sns_client: Any,
    sqs_client: Any,
    tmp_path: Path,
) -> None:
    name = unique_topic_name(fifo=False)
    arn = topic_arn(name)
    asyncio.run(route_by(pg_dsn, db.names, OrderingMap(default_ordered=False)))
    ids = db.insert([(f"order-{i % 5}", "CustomerNotified", {"i": i}) for i in range(20)])
    # Settings from each source: the topic and region from the TOML file's [sns] table, the
    # endpoint from a RELAY_* variable, the database from flags.
    config = tmp_path / "relay.toml"
    config.write_text(f'[sns]\ntopic_arn = "{arn}"\nregion = "us-east-1"\n')
    env = relay_env(RELAY_ENDPOINT_URL=moto_endpoint)
    relay = RelayProcess(
        "start", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema,
        "--broker", "sns", "--workers", "2", "--poll-interval", "100ms", "--ordering-default", "unordered",
        env=env,
    )  # fmt: skip
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
        assert len(outage_lines) == 1 and arn in outage_lines[0] and "NotFound" in outage_lines[0], relay.stderr()

        create_topic(sns_client, name)
        queue = subscribe_queue(sns_client, sqs_client, arn)
        created = time.monotonic()
        assert wait_until(lambda: db.statuses() == {"done": 20}, timeout=15), db.statuses()
        took = time.monotonic() - created
        assert took < 8, f"took {took:.1f}s after the topic appeared"
        assert "delivery resumed" in relay.stderr()
        assert relay.stop() == 0, relay.stderr()[-3000:]
    finally:
        relay.close()
    assert sorted(r.outbox_id for r in receive_all(sqs_client, queue)) == ids
    sns_client.delete_topic(TopicArn=arn)
    sqs_client.delete_queue(QueueUrl=queue)


def test_start_without_a_topic_arn_exits_2_with_one_line(pg_dsn: str) -> None:
    assert_one_line_error(run_relay("start", "--dsn", pg_dsn, "--broker", "sns"), "no SNS topic: pass --topic-arn")


def test_start_with_a_region_in_both_aws_tables_exits_2_with_one_line(
    pg_dsn: str, relay_dsn: str, tmp_path: Path
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('[sqs]\nregion = "eu-west-1"\n[sns]\nregion = "us-east-1"\n')
    done = run_relay("start", "--config", str(config), "--dsn", pg_dsn, "--broker", "sns")
    assert_one_line_error(done, "region in both [sqs] and [sns]")
