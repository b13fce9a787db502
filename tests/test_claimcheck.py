"""Claim-check (--claim-check-bucket, relay.claimcheck) against moto's S3 and SQS in server
mode: payloads across the threshold reach an SQS consumer whole, the large ones through
the store, each checked against its digest by the consumer's own code (boto3 and hashlib,
not the relay's); a store that cannot take payloads holds only the messages that need it,
with no attempt spent."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from typing import Any

import boto3
import pytest

from tests.conftest import Db
from tests.relay_process import RelayProcess, relay_env, run_relay, wait_until
from tests.sqs_server import Received, receive_all

THRESHOLD = 1024


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")


def fetch(s3: Any, received: Received) -> bytes:
    """What a consumer does with a claim-checked message: fetch the object the reference
    names and check it against the digest the message carries."""
    reference = json.loads(received.body)
    assert received.attributes["dataref"] == reference["dataref"]
    bucket, key = reference["dataref"].removeprefix("s3://").split("/", 1)
    body: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    expected = received.attributes["datadigest"].removeprefix("sha-256=")
    assert base64.b64encode(hashlib.sha256(body).digest()).decode() == expected, "digest mismatch"
    assert len(body) == reference["size"]
    return body


def relay_args(db: Db, relay_dsn: str, queue: str, endpoint: str, bucket: str) -> list[str]:
    return [
        "start", "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "sqs", "--queue-url", queue,
        "--endpoint-url", endpoint, "--region", "us-east-1", "--poll-interval", "100ms",
        "--claim-check-bucket", bucket, "--claim-check-endpoint-url", endpoint,
        "--claim-check-threshold", str(THRESHOLD), "--backoff-base", "100ms",
    ]  # fmt: skip


def test_payloads_across_the_threshold_reach_the_consumer_whole(
    db: Db, relay_dsn: str, make_queue: Any, sqs_client: Any, s3: Any, moto_endpoint: str, relays: list[RelayProcess]
) -> None:
    bucket = f"claims-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    queue = make_queue(fifo=True)
    # From an empty object to 1 MB, around the threshold: SQS alone takes at most 256 KiB.
    sizes = [0, 100, THRESHOLD - 20, THRESHOLD + 1, 50_000, 300_000, 1_000_000]
    payloads = [{"blob": "x" * n} for n in sizes]
    ids = db.insert((f"doc-{i % 2}", "DocumentStored", p) for i, p in enumerate(payloads))
    relay = RelayProcess(*relay_args(db, relay_dsn, queue, moto_endpoint, bucket), env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: db.settled(len(ids)), timeout=60), relay.tail()
    assert db.statuses() == {"done": len(ids)}
    rows = {r["id"]: r for r in db.rows()}
    got: dict[int, Any] = {}
    for received in receive_all(sqs_client, queue, idle_s=1.0):
        oid = received.outbox_id
        claimed = "dataref" in received.attributes
        body = fetch(s3, received) if claimed else received.body.encode()
        assert claimed == (rows[oid]["payload_bytes"] > THRESHOLD), (oid, rows[oid]["payload_bytes"])
        got[oid] = json.loads(body)
        if claimed:  # one object per event, named by its id: a retry or a replay writes it again
            key = f"outbox-relay/{rows[oid]['event_id']}"
            assert received.attributes["dataref"] == f"s3://{bucket}/{key}"
    assert got == {i: rows[i]["payload"] for i in ids}
    relay.stop()
    relay.assert_clean_exit()
    # A replay sends the same references: the objects the live delivery stored, no new ones.
    stored = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    replayed = run_relay(
        "replay", "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "sqs", "--queue-url", queue,
        "--endpoint-url", moto_endpoint, "--region", "us-east-1", "--claim-check-bucket", bucket,
        "--claim-check-endpoint-url", moto_endpoint, "--claim-check-threshold", str(THRESHOLD),
        "--from-id", str(ids[0]), "--run-id", "rebuild-1", env=relay_env(),
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    again = [r for r in receive_all(sqs_client, queue, idle_s=1.0) if r.attributes.get("replay") == "rebuild-1"]
    assert sorted(r.outbox_id for r in again) == ids
    assert {json.loads(fetch(s3, r)) == rows[r.outbox_id]["payload"] for r in again if "dataref" in r.attributes} == {
        True
    }
    assert {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])} == stored


def test_a_store_that_cannot_take_payloads_holds_only_their_messages_unspent(
    db: Db, relay_dsn: str, make_queue: Any, sqs_client: Any, s3: Any, moto_endpoint: str, relays: list[RelayProcess]
) -> None:
    bucket = f"claims-{uuid.uuid4().hex[:10]}"  # not created yet
    queue = make_queue(fifo=False)
    small = db.insert([("a", "Small", {"n": 1}), ("b", "Small", {"n": 2})])
    large = db.insert([("c", "Large", {"blob": "y" * 5000})])
    relay = RelayProcess(*relay_args(db, relay_dsn, queue, moto_endpoint, bucket), env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: all(db.row(i)["status"] == "done" for i in small), timeout=30), relay.tail()
    assert wait_until(lambda: "NoSuchBucket" in relay.stderr(), timeout=10), relay.tail()
    row = next(r for r in db.at_rest() if r["id"] == large[0])
    assert (row["status"], row["attempts"]) == ("pending", 0), row
    s3.create_bucket(Bucket=bucket)
    assert wait_until(lambda: db.row(large[0])["status"] == "done", timeout=30), relay.tail()
    assert db.row(large[0])["attempts"] == 1
    [received] = [r for r in receive_all(sqs_client, queue, idle_s=0.5) if r.outbox_id == large[0]]
    assert json.loads(fetch(s3, received)) == {"blob": "y" * 5000}
    relay.stop()
    relay.assert_clean_exit()
