"""Claim-check (--claim-check-bucket, relay.claimcheck) against moto's S3 and SQS in server
mode: payloads across the threshold reach an SQS consumer whole, the large ones through
the store, each checked against its digest by the consumer's own code (boto3 and hashlib,
not the relay's); a store that cannot take payloads holds only the messages that need it,
with no attempt spent."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import random
import uuid
from pathlib import Path
from typing import Any

import boto3
import psycopg
import pytest
from cloudevents.core.bindings import http as ce_http
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay import Consumer, Inbox, Received, received_from_sqs
from relay.claimcheck import PayloadFetcher
from relay.consumers.verdict import Verdict
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.partitions import PartitionSpec
from tests.conftest import Db, Roles
from tests.helpers import free_port, http_get
from tests.rabbitmq_broker import TcpProxy
from tests.relay_process import (
    RelayProcess,
    assert_one_line_error,
    kill_relays_while,
    relay_env,
    run_relay,
    wait_until,
    wait_until_async,
)
from tests.sqs_server import Received as SqsReceived
from tests.sqs_server import receive_all

THRESHOLD = 1024


@pytest.fixture
def s3(moto_endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")


def new_bucket(s3: Any, *, create: bool = True) -> str:
    """A bucket name of this test's own, created unless ``create`` is False."""
    bucket = f"claims-{uuid.uuid4().hex[:10]}"
    if create:
        s3.create_bucket(Bucket=bucket)
    return bucket


def fetch(s3: Any, received: SqsReceived) -> bytes:
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
    bucket = new_bucket(s3)
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
    bucket = new_bucket(s3, create=False)  # created later
    queue = make_queue(fifo=False)
    small = db.insert([("a", "Small", {"n": 1}), ("b", "Small", {"n": 2})])
    large = db.insert([("c", "Large", {"blob": "y" * 5000})])
    port = free_port()
    args = relay_args(db, relay_dsn, queue, moto_endpoint, bucket)
    relay = RelayProcess(*args, "--metrics-port", str(port), "--metrics-host", "127.0.0.1", env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: all(db.row(i)["status"] == "done" for i in small), timeout=30), relay.tail()
    assert wait_until(lambda: "NoSuchBucket" in relay.stderr(), timeout=10), relay.tail()
    status, body = http_get(f"http://127.0.0.1:{port}/readyz")
    assert status == 503 and f"claim-check bucket s3://{bucket} missing" in body, (status, body)
    # Named at start as a missing destination is (relay.readiness), and checked again until it is there.
    assert f"claim-check bucket s3://{bucket} missing" in relay.stderr(), relay.tail()
    row = next(r for r in db.at_rest() if r["id"] == large[0])
    assert (row["status"], row["attempts"]) == ("pending", 0), row
    s3.create_bucket(Bucket=bucket)
    assert wait_until(lambda: db.row(large[0])["status"] == "done", timeout=30), relay.tail()
    assert db.row(large[0])["attempts"] == 1
    assert wait_until(lambda: f"claim-check bucket s3://{bucket} is there now" in relay.stderr(), timeout=20), (
        relay.tail()
    )
    assert wait_until(lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, timeout=10), relay.tail()
    [received] = [r for r in receive_all(sqs_client, queue, idle_s=0.5) if r.outbox_id == large[0]]
    assert json.loads(fetch(s3, received)) == {"blob": "y" * 5000}
    relay.stop()
    relay.assert_clean_exit()


# A payload over the claim's byte budget (1 MiB here) and the threshold is read out of
# PostgreSQL a slice at a time into a file, not into memory (relay.message.SpooledPayload);
# its memory is measured by scripts/bench_claimcheck.py (BENCHMARKS.md), not here.
@pytest.mark.parametrize(
    ("large", "envelope"),
    [
        (2_000_000, "relay"),
        pytest.param(100_000_000, "relay", marks=pytest.mark.extended),
        (2_000_000, "cloudevents-json"),
    ],
    ids=["2MB", "100MB", "2MB-cloudevents"],
)
async def test_the_consumer_fetches_checks_and_streams_each_payload(
    large: int,
    envelope: str,
    db: Db,
    relay_dsn: str,
    make_queue: Any,
    sqs_client: Any,
    s3: Any,
    moto_endpoint: str,
    scratch_dsn: str,
    relays: list[RelayProcess],
) -> None:
    bucket = new_bucket(s3)
    queue = make_queue(fifo=True)
    payloads = [{"n": 1}, {"blob": "z" * 40_000}, {"blob": "w" * large}]
    ids = db.insert((f"doc-{i}", "DocumentStored", p) for i, p in enumerate(payloads))
    args = relay_args(db, relay_dsn, queue, moto_endpoint, bucket)
    relays.append(RelayProcess(*args, "--batch-bytes", "1MiB", "--envelope", envelope, env=relay_env()))
    assert wait_until(lambda: db.settled(len(ids)), timeout=120), relays[-1].tail()
    with psycopg.connect(scratch_dsn) as conn:
        Inbox().migrate(conn)
        conn.execute("CREATE TABLE documents (event_id uuid PRIMARY KEY, bytes bigint, sha256 text, streamed int)")
    fetched_into: list[Path] = []

    async def store(conn: psycopg.AsyncConnection[Any], event: Received) -> None:
        # The documented way to read a payload of any size: a stream, chunk by chunk.
        sha, size, reads = hashlib.sha256(), 0, 0
        with event.open_payload() as fh:
            while chunk := fh.read(256 * 1024):
                sha.update(chunk)
                size, reads = size + len(chunk), reads + 1
        if event.payload_path is not None:
            fetched_into.append(event.payload_path)
        await conn.execute(
            "INSERT INTO documents VALUES (%s, %s, %s, %s)", (event.event_id, size, sha.hexdigest(), reads)
        )

    async with AsyncConnectionPool(scratch_dsn, min_size=1, max_size=4, open=False) as pool:
        consumer = Consumer(pool, Inbox(), store, claim_check=PayloadFetcher(s3))
        for received in await asyncio.to_thread(receive_all, sqs_client, queue, idle_s=1.0):
            message = {
                "MessageId": "m",
                "Body": received.body,
                "MessageAttributes": {
                    k: {"DataType": received.data_types.get(k, "String"), "StringValue": v}
                    for k, v in received.attributes.items()
                },
            }
            assert await consumer.apply(received_from_sqs(message)) == Verdict.APPLIED
    rows = {str(r["event_id"]): r for r in db.rows()}
    with psycopg.connect(scratch_dsn) as conn:
        got = {str(e): (n, h, reads) for e, n, h, reads in conn.execute("SELECT * FROM documents").fetchall()}
    for event_id, (size, sha, reads) in got.items():
        # The bytes the producer's JSON has as PostgreSQL renders it (one key: as json.dumps does).
        text = json.dumps(rows[event_id]["payload"]).encode()
        assert (size, sha) == (len(text), hashlib.sha256(text).hexdigest()), event_id
        assert reads >= 1
    assert len(got) == len(ids) and len(fetched_into) == 2  # the two over the threshold came from the store
    assert max(r for _, _, r in got.values()) >= 8  # the 2 MB payload streamed in 256 KiB reads
    assert not any(p.exists() for p in fetched_into)  # each fetched file removed after its transaction
    # A changed object is refused, not applied: its digest no longer matches.
    [big] = [r for r in db.rows() if r["id"] == ids[1]]
    s3.put_object(Bucket=bucket, Key=f"outbox-relay/{big['event_id']}", Body=b'{"blob": "tampered"}')
    original = json.dumps(big["payload"]).encode()
    digest = "sha-256=" + base64.b64encode(hashlib.sha256(original).digest()).decode()
    with pytest.raises(ValueError, match="does not match its datadigest"):
        await PayloadFetcher(s3).fetch(f"s3://{bucket}/outbox-relay/{big['event_id']}", digest)


@pytest.mark.parametrize(
    "missing_s", [pytest.param(4, id="4s"), pytest.param(20, id="20s", marks=pytest.mark.extended)]
)
async def test_the_store_gone_mid_run_holds_its_messages_unspent_then_all_flow(
    missing_s: int,
    db: Db,
    relay_dsn: str,
    make_queue: Any,
    sqs_client: Any,
    s3: Any,
    moto_endpoint: str,
    relays: list[RelayProcess],
) -> None:
    bucket = new_bucket(s3)
    queue = make_queue(fifo=False)
    host, port = moto_endpoint.removeprefix("http://").split(":")
    proxy = TcpProxy(host, int(port))
    await proxy.start()
    store = f"http://127.0.0.1:{proxy.port}"
    args = relay_args(db, relay_dsn, queue, moto_endpoint, bucket)
    args[args.index("--claim-check-endpoint-url") + 1] = store
    relays.append(RelayProcess(*args, env=relay_env()))
    first = db.insert((f"doc-{i}", "DocumentStored", {"blob": "a" * 2000, "i": i}) for i in range(5))
    assert await wait_until_async(lambda: db.settled(len(first)), timeout=30), relays[-1].tail()
    await proxy.cut()  # the object store is gone: its connections reset, new ones refused
    large = db.insert((f"doc-{i}", "DocumentStored", {"blob": "b" * 2000, "i": i}) for i in range(5, 15))
    small = db.insert((f"note-{i}", "NoteAdded", {"i": i}) for i in range(5))
    assert await wait_until_async(lambda: all(db.row(i)["status"] == "done" for i in small), timeout=30)
    await asyncio.sleep(missing_s)
    held = [r for r in await asyncio.to_thread(db.at_rest) if r["id"] in large]
    assert {(r["status"], r["attempts"]) for r in held} == {("pending", 0)}, held
    await proxy.restore()
    assert await wait_until_async(lambda: db.settled(len(first) + len(large) + len(small)), timeout=60)
    rows = {r["id"]: r for r in db.rows()}
    assert {r["status"] for r in rows.values()} == {"done"} and {r["attempts"] for r in rows.values()} == {1}
    got = {r.outbox_id: r for r in await asyncio.to_thread(receive_all, sqs_client, queue, idle_s=1.0)}
    assert set(got) == set(rows)
    for i in [*first, *large]:
        assert json.loads(await asyncio.to_thread(fetch, s3, got[i])) == rows[i]["payload"]
    await proxy.cut()


def test_objects_that_cannot_be_named_are_not_stored_and_their_messages_wait_unspent(
    db: Db,
    roles: Roles,
    relay_dsn: str,
    make_queue: Any,
    sqs_client: Any,
    s3: Any,
    moto_endpoint: str,
    relays: list[RelayProcess],
) -> None:
    """An outbox migrated to 0019 whose relay role was not granted <table>_payloads again
    (docs/upgrading.md): the large message waits, no attempt spent and no object written,
    while the small ones go; granted, it goes."""
    bucket = new_bucket(s3)
    queue = make_queue(fifo=False)
    payloads = sql.Identifier(db.names.schema, f"{db.names.table}_payloads")
    db.conn.execute(sql.SQL("REVOKE ALL ON {} FROM {}").format(payloads, sql.Identifier(roles.relay)))
    small = db.insert([("a", "Small", {"n": 1})])
    large = db.insert([("c", "Large", {"blob": "z" * 5000})])
    relay = RelayProcess(*relay_args(db, relay_dsn, queue, moto_endpoint, bucket), env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: db.row(small[0])["status"] == "done", timeout=30), relay.tail()
    assert wait_until(lambda: "could not be recorded" in relay.stderr(), timeout=10), relay.tail()
    row = next(r for r in db.at_rest() if r["id"] == large[0])
    assert (row["status"], row["attempts"]) == ("pending", 0), row
    assert not s3.list_objects_v2(Bucket=bucket).get("Contents")
    db.conn.execute(
        sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(payloads, sql.Identifier(roles.relay))
    )
    assert wait_until(lambda: db.row(large[0])["status"] == "done", timeout=30), relay.tail()
    assert db.row(large[0])["attempts"] == 1 and len(recorded(db)) == 1
    relay.stop()
    relay.assert_clean_exit()


async def test_killed_relays_leave_no_object_without_its_row_and_lose_nothing(
    pg_dsn: str,
    db: Db,
    relay_dsn: str,
    make_queue: Any,
    sqs_client: Any,
    s3: Any,
    moto_endpoint: str,
    relays: list[RelayProcess],
) -> None:
    bucket = new_bucket(s3)
    queue = make_queue(fifo=False)
    ids = db.insert((f"doc-{i % 7}", "DocumentStored", {"blob": "c" * 3000, "i": i}) for i in range(60))

    def start() -> None:
        args = relay_args(db, relay_dsn, queue, moto_endpoint, bucket)
        relays.append(
            RelayProcess(*args, "--lease", "2s", "--publish-timeout", "1s", "--batch-size", "5", env=relay_env())
        )

    start()
    start()
    kills = await asyncio.to_thread(
        kill_relays_while, lambda: not db.settled(len(ids)), relays, start, random.Random(42), at_least=2
    )
    assert await wait_until_async(lambda: db.settled(len(ids)), timeout=60), relays[-1].tail()
    rows = {r["id"]: r for r in db.rows()}
    assert {r["status"] for r in rows.values()} == {"done"} and kills >= 2
    got = await asyncio.to_thread(receive_all, sqs_client, queue, idle_s=1.0)
    assert {r.outbox_id for r in got} == set(ids)  # duplicates allowed: consumers de-duplicate by event id
    for r in got:
        assert json.loads(await asyncio.to_thread(fetch, s3, r)) == rows[r.outbox_id]["payload"]
    # One object per event, each named by the event id of a row that exists: no orphan, no copy.
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert keys == {f"outbox-relay/{r['event_id']}" for r in rows.values()}
    # Each named where prune finds it, for the row it was stored for.
    assert recorded(db) == {
        f"s3://{bucket}/{k}": oid for k, oid in ((f"outbox-relay/{r['event_id']}", r["id"]) for r in rows.values())
    }
    pruned = run_relay(*prune_args(pg_dsn, db, moto_endpoint, "--older-than", "0s"), env=relay_env())
    assert pruned.returncode == 0, pruned.stderr
    assert f"deleted {len(ids)} stored payloads of rows that left history" in pruned.stdout, pruned.stdout
    assert not s3.list_objects_v2(Bucket=bucket).get("Contents") and recorded(db) == {}


def recorded(db: Db) -> dict[str, int]:
    """<table>_payloads: each stored object's reference and the row it was stored for."""
    table = sql.Identifier(db.names.schema, f"{db.names.table}_payloads")
    return dict(db.conn.execute(sql.SQL("SELECT ref, outbox_id FROM {}").format(table)).fetchall())


def prune_args(dsn: str, db: Db, endpoint: str, *more: str) -> list[str]:
    """relay prune as the outbox's owner (``dsn``), who may drop partitions too."""
    return ["prune", "--dsn", dsn, "--schema", db.names.schema, "--claim-check-endpoint-url", endpoint, *more]


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
async def test_prune_deletes_the_objects_of_rows_that_left_history_and_only_those(
    pg_dsn: str,
    names: OutboxNames,
    db: Db,
    partitioned: bool,
    relay_dsn: str,
    make_queue: Any,
    s3: Any,
    moto_endpoint: str,
    relays: list[RelayProcess],
) -> None:
    """Two large rows finish long ago, a third just now: prune (a DELETE, or the drop of the
    partition holding ids 1-2) deletes the first two objects and keeps the third, which a
    replay may still need. With the store unreachable the rows go and the objects wait,
    named, for the next prune."""
    if partitioned:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            await migrate(conn, names, PartitionSpec(size=3, ahead=3))
    bucket = new_bucket(s3)
    queue = make_queue(fifo=False)
    ids = db.insert([(f"doc-{i}", "DocumentStored", {"blob": "p" * 4000, "i": i}) for i in range(3)])
    ids += db.insert([("small", "Small", {})])
    relay = RelayProcess(*relay_args(db, relay_dsn, queue, moto_endpoint, bucket), env=relay_env())
    relays.append(relay)
    assert await wait_until_async(lambda: db.settled(len(ids)), timeout=60), relay.tail()
    relay.stop()
    db.conn.execute(
        sql.SQL(
            "UPDATE {} SET created_at = now() - interval '3 days', done_at = now() - interval '2 days'"
            " WHERE id = ANY(%s)"
        ).format(db.table),
        (ids[:2],),
    )
    event = {r["id"]: r["event_id"] for r in db.rows()}
    ref = {i: f"s3://{bucket}/outbox-relay/{event[i]}" for i in ids[:3]}
    assert recorded(db) == {ref[i]: i for i in ids[:3]}

    def keys() -> set[str]:
        return {f"s3://{bucket}/{o['Key']}" for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}

    dry = run_relay(*prune_args(pg_dsn, db, moto_endpoint, "--older-than", "1d", "--dry-run"), env=relay_env())
    # A dry run removes no row, so no object is unneeded yet: it names only what has left already.
    assert dry.returncode == 0 and "stored payload" not in dry.stdout, (dry.stdout, dry.stderr)
    cut = run_relay(*prune_args(pg_dsn, db, "http://127.0.0.1:9", "--older-than", "1d"), env=relay_env())
    assert cut.returncode == 0, cut.stderr
    assert "2 or more stored payloads of rows that left history were not deleted" in cut.stdout, cut.stdout
    dry = run_relay(*prune_args(pg_dsn, db, moto_endpoint, "--older-than", "1d", "--dry-run"), env=relay_env())
    assert "would delete 2 stored payloads of rows that left history" in dry.stdout, (dry.stdout, dry.stderr)
    assert {r["id"] for r in db.rows()}.isdisjoint(ids[:2])
    assert keys() == set(ref.values()) and recorded(db) == {ref[i]: i for i in ids[:3]}
    again = run_relay(*prune_args(pg_dsn, db, moto_endpoint, "--older-than", "1d"), env=relay_env())
    assert again.returncode == 0 and "deleted 2 stored payloads" in again.stdout, (again.stdout, again.stderr)
    assert keys() == {ref[ids[2]]} and recorded(db) == {ref[ids[2]]: ids[2]}
    quiet = run_relay(*prune_args(pg_dsn, db, moto_endpoint, "--older-than", "1d"), env=relay_env())
    assert quiet.returncode == 0 and "stored payload" not in quiet.stdout, quiet.stdout


def test_each_route_writes_its_own_envelope_and_claim_check(
    db: Db,
    relay_dsn: str,
    make_queue: Any,
    sqs_client: Any,
    s3: Any,
    moto_endpoint: str,
    tmp_path: Path,
    relays: list[RelayProcess],
) -> None:
    """[[routes]] set their own envelope and claim-check over the relay's: documents go as
    CloudEvents (read by the cloudevents SDK) through their own bucket from 2 KiB, audit
    entries are never claim-checked, everything else takes the relay's 1 KiB and bucket."""
    relay_bucket, documents_bucket = new_bucket(s3), new_bucket(s3)
    default_queue, documents, audit = make_queue(fifo=False), make_queue(fifo=False), make_queue(fifo=False)
    config = tmp_path / "relay.toml"
    config.write_text(
        f"""
[[routes]]
match = ["Document*"]
queue_url = "{documents}"
envelope = "cloudevents-json"
cloudevents_source = "urn:test:documents"
claim_check_bucket = "{documents_bucket}"
claim_check_threshold = "2KiB"

[[routes]]
match = ["Audit*"]
queue_url = "{audit}"
claim_check = false
""",
        encoding="utf-8",
    )
    small_doc, large_doc, audit_entry, other = db.insert(
        [
            ("d-1", "DocumentStored", {"blob": "a" * 1500}),
            ("d-2", "DocumentStored", {"blob": "b" * 5000}),
            ("u-1", "AuditLogged", {"blob": "c" * 5000}),
            ("o-1", "OrderPlaced", {"blob": "d" * 5000}),
        ]
    )
    args = relay_args(db, relay_dsn, default_queue, moto_endpoint, relay_bucket)
    relay = RelayProcess(*args, "--config", str(config), env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: db.settled(4), timeout=60), relay.tail()
    rows = {r["id"]: r for r in db.rows()}

    def objects(bucket: str) -> set[str]:
        return {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}

    assert objects(documents_bucket) == {f"outbox-relay/{rows[large_doc]['event_id']}"}
    assert objects(relay_bucket) == {f"outbox-relay/{rows[other]['event_id']}"}
    events = {}
    for received in receive_all(sqs_client, documents, idle_s=1.0):
        assert received.attributes["content-type"].startswith("application/cloudevents+json")
        message = ce_http.HTTPMessage(
            headers={"content-type": received.attributes["content-type"]}, body=received.body.encode()
        )
        event = ce_http.from_http_event(message)
        assert (event.get_source(), event.get_type()) == ("urn:test:documents", "DocumentStored")
        events[event.get_id()] = event
    small, large = events[str(rows[small_doc]["event_id"])], events[str(rows[large_doc]["event_id"])]
    assert small.get_data() == rows[small_doc]["payload"] and small.get_extension("dataref") is None
    dataref = large.get_extension("dataref")
    assert dataref == f"s3://{documents_bucket}/outbox-relay/{rows[large_doc]['event_id']}"
    body = s3.get_object(Bucket=documents_bucket, Key=dataref.split("/", 3)[3])["Body"].read()
    assert json.loads(body) == rows[large_doc]["payload"]
    [plain] = receive_all(sqs_client, audit, idle_s=0.5)
    assert "dataref" not in plain.attributes and json.loads(plain.body) == rows[audit_entry]["payload"]
    [referenced] = receive_all(sqs_client, default_queue, idle_s=0.5)
    assert json.loads(fetch(s3, referenced)) == rows[other]["payload"]
    # A route's value is checked as the relay's own option is: one line, exit 2.
    config.write_text('[[routes]]\nmatch = ["A"]\nqueue_url = "q"\nclaim_check_threshold = "lots"\n', encoding="utf-8")
    assert_one_line_error(run_relay(*args, "--config", str(config), env=relay_env()), "route 1", "claim")
