"""CloudEvents 1.0 envelopes (--envelope cloudevents / cloudevents-json, relay.cloudevents):
every event the relay writes is read back with the `cloudevents` SDK's own bindings (HTTP
and Kafka), never with the relay's code, and carries the row's identity, type, subject,
time, order and trace context."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.bindings import rabbitmq as ce_rabbitmq

from relay import (
    Received,
    received_from_aio_pika,
    received_from_kafka,
    received_from_nats,
    received_from_sqs,
    received_from_webhook,
)
from relay.cloudevents import JSON, STRUCTURED_CONTENT_TYPE, binary_headers, structured_body
from relay.message import OutboxMessage
from tests.aws_destinations import AwsWorld
from tests.conftest import Db
from tests.deliveries import store_fleet_ordering
from tests.http_receiver import Receiver, http_relay
from tests.kafka_broker import KafkaService
from tests.nats_server import NatsStream
from tests.producers import Arrival, order_violations, producers_of_kind
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay, wait_until
from tests.sqs_server import receive_all

SOURCE = "urn:test:orders"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def message(**over: Any) -> OutboxMessage:
    fields: dict[str, Any] = {
        "id": 41,
        "aggregate_type": "order",
        "aggregate_id": "order-7 / ü",
        "event_type": "OrderPaid",
        "body": b'{"total": "19.90", "items": [1, 2]}',
        "attempt": 2,
        "lease_version": 5,
        "ordered": True,
        "aggregate_seq": 3,
        "aggregate_epoch": "1.1.n4",
        "event_id": "0b5f6c1e-9a44-4f7e-8f0c-2a4a1b7c9d11",
        "created_at": datetime(2026, 12, 4, 10, 30, 15, 250000, tzinfo=UTC),
        "headers": {"traceparent": TRACEPARENT, "tenant": "acme", "X-Request-Id": "r-1"},
    }
    return OutboxMessage(**{**fields, **over})


def check_event(event: BaseCloudEvent, m: OutboxMessage, *, source: str = SOURCE) -> None:
    """What every event of ``m`` says, as the SDK reads it."""
    assert (event.get_specversion(), event.get_id(), event.get_source()) == ("1.0", m.event_id, source)
    assert (event.get_type(), event.get_subject()) == (m.event_type, m.aggregate_id)
    assert event.get_datacontenttype() == JSON
    assert event.get_time() == m.created_at
    assert str(event.get_extension("outboxid")) == str(m.id)
    assert str(event.get_extension("aggregateseq")) == str(m.aggregate_seq)
    assert event.get_extension("aggregateepoch") == m.aggregate_epoch
    assert str(event.get_extension("leaseversion")) == str(m.lease_version)
    assert event.get_extension("aggregatetype") == m.aggregate_type
    data = event.get_data()
    assert (json.loads(data) if isinstance(data, bytes | str) else data) == json.loads(m.body)


def assert_reads_as(received: Received, row: dict[str, Any]) -> None:
    """relay.Inbox's receive helper read the CloudEvent as the row the producer wrote (the
    oracle: the row, as the SDK's reading of the same message also matched it)."""
    assert (received.event_id, received.event_type, received.aggregate_id, received.aggregate_type) == (
        row["event_id"],
        row["event_type"],
        row["aggregate_id"],
        row["aggregate_type"],
    )
    assert (received.outbox_id, received.aggregate_seq, received.aggregate_epoch) == (
        row["id"],
        row["aggregate_seq"],
        row["aggregate_epoch"],
    )
    assert received.payload() == row["payload"]
    assert not {"specversion", "source", "id", "time"} & set(received.headers), received.headers


def test_binary_mode_reads_back_through_the_http_and_kafka_bindings() -> None:
    m = message()
    # HTTP: ce- headers (the adapter sends each header value escaped as the binding's SDK reads it).
    from relay.adapters.header_text import header_value

    headers = {k: header_value(v) for k, v in binary_headers(m, SOURCE, "ce-").items()}
    headers["content-type"] = JSON
    event = ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=m.body))
    check_event(event, m)
    assert event.get_extension("traceparent") == TRACEPARENT and event.get_extension("tenant") == "acme"
    assert headers["X-Request-Id"] == "r-1"  # not an attribute name: a plain header beside them
    # Kafka: ce_ headers as bytes.
    kheaders = {k: v.encode() for k, v in binary_headers(m, SOURCE, "ce_").items()}
    kheaders["content-type"] = JSON.encode()
    kevent = ce_kafka.from_kafka_event(ce_kafka.KafkaMessage(headers=kheaders, key=b"order-7", value=m.body))
    check_event(kevent, m)


def test_structured_mode_is_one_json_document_with_the_payload_as_json() -> None:
    m = message(headers=None, aggregate_seq=None, aggregate_epoch=None, ordered=False)
    body = structured_body(m, SOURCE)
    document = json.loads(body)
    assert document["data"] == json.loads(m.body) and "aggregateseq" not in document
    event = ce_http.from_http_event(ce_http.HTTPMessage(headers={"content-type": STRUCTURED_CONTENT_TYPE}, body=body))
    assert (event.get_id(), event.get_type(), event.get_time()) == (m.event_id, "OrderPaid", m.created_at)
    kevent = ce_kafka.from_kafka_event(
        ce_kafka.KafkaMessage(headers={"content-type": STRUCTURED_CONTENT_TYPE.encode()}, key=None, value=body)
    )
    assert kevent.get_id() == m.event_id and kevent.get_data() == json.loads(m.body)


def test_a_producer_header_cannot_pose_as_an_attribute_the_relay_sets() -> None:
    m = message(headers={"id": "forged", "type": "Forged", "outboxid": "1", "ok": "yes"})
    headers = binary_headers(m, SOURCE, "ce-")
    assert headers["ce-id"] == m.event_id and headers["ce-type"] == "OrderPaid" and headers["ce-outboxid"] == "41"
    assert headers["ce-ok"] == "yes"


def test_an_envelope_a_destination_cannot_write_is_refused_in_one_line() -> None:
    proc = run_relay(
        "start", "--dsn", "postgresql://relay@127.0.0.1:1/x", "--broker", "log", "--envelope", "cloudevents",
        env=relay_env(),
    )  # fmt: skip
    assert_one_line_error(proc, "--envelope cloudevents: --broker log does not write CloudEvents")


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-json"])
def test_http_receivers_read_each_event_with_the_sdk_in_commit_order(
    envelope: str, db: Db, relay_dsn: str, receivers: Any, relays: list[RelayProcess], tmp_path: Path
) -> None:
    receiver: Receiver = receivers()
    ids = db.insert((f"order-{i % 3}", "OrderPlaced" if i < 3 else "OrderPaid", {"i": i}) for i in range(12))
    relay = http_relay(
        db.names, receiver.url, "--envelope", envelope, "--cloudevents-source", SOURCE,
        env=relay_env(RELAY_DSN=relay_dsn), relays=relays,
    )  # fmt: skip
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), relay.tail()
    rows = {str(r["event_id"]): r for r in db.rows()}
    seqs: dict[str, list[int]] = {}
    seen = []
    for request in receiver.requests():
        headers = json.loads(request["headers"]) if isinstance(request["headers"], str) else request["headers"]
        event = ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=request["body"].encode()))
        row = rows[event.get_id()]
        assert event.get_source() == SOURCE and event.get_type() == row["event_type"]
        assert event.get_subject() == row["aggregate_id"] and event.get_time() == row["created_at"]
        assert event.get_data() == row["payload"] or json.loads(event.get_data()) == row["payload"]  # type: ignore[arg-type]
        assert str(event.get_extension("outboxid")) == str(row["id"])
        assert_reads_as(received_from_webhook(headers, request["body"].encode(), secrets=None), row)
        seqs.setdefault(row["aggregate_id"], []).append(int(event.get_extension("aggregateseq")))
        seen.append(int(row["id"]))
    assert sorted(seen) == ids  # each event once (every answer was 200)
    # Written by one connection in id order: each aggregate's events arrive numbered 1, 2, 3, 4.
    assert all(got == list(range(1, len(got) + 1)) for got in seqs.values()), seqs
    relay.stop()
    relay.assert_clean_exit()


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-json"])
def test_kafka_consumers_read_each_record_with_the_sdk(
    envelope: str, db: Db, relay_dsn: str, kafka: KafkaService, relays: list[RelayProcess]
) -> None:
    topic = kafka.create_topic(partitions=2)
    ids = db.insert((f"order-{i % 4}", "OrderPlaced", {"i": i}) for i in range(12))
    relay = RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "kafka", "--bootstrap-servers", kafka.bootstrap,
        "--topic", topic, "--poll-interval", "100ms", "--envelope", envelope, "--cloudevents-source", SOURCE,
        env=relay_env(RELAY_DSN=relay_dsn),
    )  # fmt: skip
    relays.append(relay)
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), relay.tail()
    rows = {str(r["event_id"]): r for r in db.rows()}
    seen = []
    for record in kafka.read(topic):
        headers = {k: v.encode() for k, v in record.headers.items()}
        event = ce_kafka.from_kafka_event(ce_kafka.KafkaMessage(headers=headers, key=record.key, value=record.value))
        row = rows[event.get_id()]
        assert (event.get_type(), event.get_subject(), event.get_source()) == (
            "OrderPlaced",
            row["aggregate_id"],
            SOURCE,
        )
        assert record.key == row["aggregate_id"].encode()  # still keyed by aggregate: one partition each
        consumed = SimpleNamespace(headers=list(headers.items()), value=record.value)  # as aiokafka gives it
        assert_reads_as(received_from_kafka(consumed), row)
        data = event.get_data()
        assert (json.loads(data) if isinstance(data, bytes | str) else data) == row["payload"]
        seen.append(int(row["id"]))
    assert sorted(seen) == ids
    relay.stop()
    relay.assert_clean_exit()


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-json"])
async def test_rabbitmq_consumers_read_each_message_with_the_sdks_rabbitmq_binding(
    envelope: str, db: Db, relay_dsn: str, rabbit: Rabbit, relays: list[RelayProcess]
) -> None:
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    ids = db.insert((f"order-{i % 3}", "OrderPlaced", {"i": i}) for i in range(9))
    relay = RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "rabbitmq", "--amqp-url", rabbit.amqp.url,
        "--exchange", exchange, "--poll-interval", "100ms", "--envelope", envelope, "--cloudevents-source", SOURCE,
        env=relay_env(RELAY_DSN=relay_dsn),
    )  # fmt: skip
    relays.append(relay)
    got = await rabbit.drain(queue, len(ids), timeout=30)
    rows = {str(r["event_id"]): r for r in db.rows()}
    seqs: dict[str, list[int]] = {}
    seen = []
    for delivered in got:
        headers = {k: str(v) for k, v in (delivered.headers or {}).items()}
        message = ce_rabbitmq.RabbitMQMessage(headers=headers, content_type=delivered.content_type, body=delivered.body)
        event = ce_rabbitmq.from_rabbitmq_event(message)
        row = rows[event.get_id()]
        assert (event.get_type(), event.get_source(), event.get_subject()) == (
            "OrderPlaced",
            SOURCE,
            row["aggregate_id"],
        )
        assert event.get_time() == row["created_at"]
        data = event.get_data()
        assert (json.loads(data) if isinstance(data, bytes | str) else data) == row["payload"]
        assert_reads_as(received_from_aio_pika(delivered), row)
        seqs.setdefault(row["aggregate_id"], []).append(int(event.get_extension("aggregateseq")))
        seen.append(int(row["id"]))
    assert sorted(seen) == ids
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values()), seqs
    relay.stop()
    relay.assert_clean_exit()


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-json"])
def test_nats_stream_messages_read_as_cloudevents(
    envelope: str, db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    nats_stream.create()
    ids = db.insert((f"order-{i % 3}", "OrderPlaced", {"i": i}) for i in range(9))
    relay = RelayProcess(
        "start", "--schema", db.names.schema, "--broker", "nats", "--nats-url", nats_stream.url,
        "--subject", nats_stream.subject("orders"), "--poll-interval", "100ms", "--envelope", envelope,
        "--cloudevents-source", SOURCE, env=relay_env(RELAY_DSN=relay_dsn),
    )  # fmt: skip
    relays.append(relay)
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), relay.tail()
    rows = {str(r["event_id"]): r for r in db.rows()}
    seen = []
    for m in nats_stream.read():
        # NATS headers carry the attributes as the HTTP binding's ce- headers do (the
        # NATS protocol binding's binary mode); the SDK's HTTP binding reads them.
        headers = {k: v for k, v in m.headers.items() if k != "Nats-Msg-Id"}
        event = ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=m.data))
        row = rows[event.get_id()]
        assert (event.get_type(), event.get_subject()) == ("OrderPlaced", row["aggregate_id"])
        assert m.headers["Nats-Msg-Id"] == str(row["event_id"])  # the stream still de-duplicates by it
        assert_reads_as(received_from_nats(m), row)
        seen.append(int(row["id"]))
    assert sorted(seen) == ids
    relay.stop()
    relay.assert_clean_exit()


def test_sqs_and_sns_carry_structured_cloudevents_and_refuse_binary_mode(
    db: Db, relay_dsn: str, aws: AwsWorld, sqs_client: Any, relays: list[RelayProcess]
) -> None:
    destination = aws.make(fifo=True)
    base = [
        "start", "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", aws.kind.broker, aws.kind.flag,
        destination.address, "--endpoint-url", aws.endpoint, "--region", "us-east-1", "--poll-interval", "100ms",
    ]  # fmt: skip
    # Binary mode would need a message attribute per CloudEvents attribute: more than AWS's 10.
    assert_one_line_error(
        run_relay(*base, "--envelope", "cloudevents", env=relay_env()), "use --envelope cloudevents-json"
    )
    ids = db.insert((f"order-{i % 3}", "OrderPlaced", {"i": i}) for i in range(9))
    relay = RelayProcess(*base, "--envelope", "cloudevents-json", "--cloudevents-source", SOURCE, env=relay_env())
    relays.append(relay)
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), relay.tail()
    rows = {str(r["event_id"]): r for r in db.rows()}
    seen: list[int] = []
    seqs: dict[str, list[int]] = {}
    for received in receive_all(sqs_client, destination.inbox, idle_s=1.0):
        assert received.attributes["content-type"].startswith("application/cloudevents+json")
        message = ce_http.HTTPMessage(
            headers={"content-type": received.attributes["content-type"]}, body=received.body.encode()
        )
        event = ce_http.from_http_event(message)
        row = rows[event.get_id()]
        assert (event.get_type(), event.get_source(), event.get_subject()) == (
            "OrderPlaced",
            SOURCE,
            row["aggregate_id"],
        )
        assert event.get_data() == row["payload"]
        attributes = {
            k: {"DataType": received.data_types.get(k, "String"), "StringValue": v}
            for k, v in received.attributes.items()
        }
        read = received_from_sqs({"MessageId": "m", "Body": received.body, "MessageAttributes": attributes})
        assert_reads_as(read, row)
        seqs.setdefault(row["aggregate_id"], []).append(int(event.get_extension("aggregateseq")))
        seen.append(int(row["id"]))
    assert sorted(seen) == ids
    assert all(s == list(range(1, len(s) + 1)) for s in seqs.values()), seqs  # FIFO: each group in order
    relay.stop()
    relay.assert_clean_exit()


@pytest.mark.parametrize(
    ("kind", "claim_check"),
    [
        pytest.param("locked", False, id="locked-inline"),
        pytest.param("unlocked", False, id="unlocked-inline"),
        pytest.param("locked", True, id="locked-claim-checked"),
        # In make test-all: make test keeps its time with the three others.
        pytest.param("unlocked", True, id="unlocked-claim-checked", marks=pytest.mark.extended),
    ],
)
def test_cloudevents_arrive_in_commit_order_from_locking_and_unlocked_producers(
    kind: str,
    claim_check: bool,
    pg_dsn: str,
    producer_dsn: str,
    relay_dsn: str,
    db: Db,
    receivers: Any,
    relays: list[RelayProcess],
    moto_endpoint: str,
) -> None:
    """Claim-checked (every payload stored: threshold 0), the order and numbering are the
    same, and each reference (the dataref extension) names the row's own payload."""
    store_fleet_ordering(pg_dsn, db.names)
    receiver: Receiver = receivers()
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="warning")
    s3 = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = f"ce-claims-{uuid.uuid4().hex[:10]}"
    store: list[str] = []
    if claim_check:
        s3.create_bucket(Bucket=bucket)
        store = ["--claim-check-bucket", bucket, "--claim-check-endpoint-url", moto_endpoint]
        store += ["--claim-check-threshold", "0"]
    for _ in range(2):  # two relays share the outbox through their leases
        http_relay(db.names, receiver.url, "--envelope", "cloudevents", *store, env=env, relays=relays)
    log, producing = producers_of_kind(pg_dsn, producer_dsn, db.names, kind, 41, aggregates=6, transactions=15)
    producing.join()
    total = len(db.rows())
    assert wait_until(lambda: db.statuses().get("done", 0) == total, timeout=60), db.statuses()
    by_event = {str(r["event_id"]): r for r in db.rows()}
    arrivals, first_seq = [], {}
    for request in receiver.requests():  # in arrival order
        headers = json.loads(request["headers"]) if isinstance(request["headers"], str) else request["headers"]
        event = ce_http.from_http_event(ce_http.HTTPMessage(headers=headers, body=request["body"].encode()))
        row = by_event[event.get_id()]
        if row["id"] in first_seq:
            continue  # a redelivery: consumers drop it by the event id
        seq = event.get_extension("aggregateseq")
        first_seq[row["id"]] = None if seq is None else int(seq)
        if claim_check:
            dataref = str(event.get_extension("dataref"))
            assert dataref == f"s3://{bucket}/outbox-relay/{row['event_id']}"
            stored = s3.get_object(Bucket=bucket, Key=dataref.split("/", 3)[3])["Body"].read()
            assert json.loads(stored) == row["payload"]
        arrivals.append(Arrival(int(row["id"]), row["aggregate_id"]))
    assert set(first_seq) == {r["id"] for r in db.rows()}
    assert order_violations(log.expected(), arrivals) == []
    numbered: dict[str, list[int]] = {}
    for a in arrivals:
        if first_seq[a.outbox_id] is not None:
            numbered.setdefault(a.aggregate_id, []).append(first_seq[a.outbox_id])  # type: ignore[arg-type]
    assert numbered and all(s == list(range(1, len(s) + 1)) for s in numbered.values()), numbered


@pytest.mark.parametrize(
    ("body", "attributes", "needle"),
    [
        ("not json", {"content-type": "application/cloudevents+json"}, "body is not JSON"),
        ("[1, 2]", {"content-type": "application/cloudevents+json"}, "not a JSON object"),
        ("[" * 100_000 + "]" * 100_000, {"content-type": "application/cloudevents+json"}, "nested too deep"),
        (
            '{"specversion": "1.0", "type": "T", "subject": "a"}',
            {"content-type": "application/cloudevents+json"},
            "no event_id",
        ),
        ("{}", {"ce-specversion": "1.0", "ce-id": "not-a-uuid", "ce-type": "T", "ce-subject": "a"}, "UUID"),
    ],
    ids=["not-json", "not-an-object", "too-deep", "no-id", "bad-id"],
)
def test_a_cloudevent_the_helpers_cannot_read_is_one_valueerror(
    body: str, attributes: dict[str, str], needle: str
) -> None:
    """What a receive helper says of a message it cannot read as an event is a ValueError
    (the consumer runners leave such a message to the broker), never another exception."""
    message = {
        "Body": body,
        "MessageAttributes": {k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()},
    }
    with pytest.raises(ValueError, match=needle):
        received_from_sqs(message)
