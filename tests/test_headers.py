"""Producers' own headers (migration 0010): they reach the publisher beside the relay's,
and a row whose headers the relay refuses goes to dead alone, the reason in last_error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.message import CLAIM_CHECK_HEADERS, RELAY_HEADERS, OutboxMessage, producer_headers
from tests.conftest import Db
from tests.helpers import make_worker, outbox_message

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def insert_with_headers(db: Db, aggregate_id: str, headers: Any) -> int:
    row = db.conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
            " VALUES ('order', %s, 'OrderPlaced', '{{}}', %s::jsonb) RETURNING id"
        ).format(db.table),
        (aggregate_id, None if headers is None else json.dumps(headers)),
    ).fetchone()
    assert row is not None
    return int(row[0])


async def test_headers_pass_through_and_bad_ones_send_their_message_alone_to_dead(store: OutboxStore, db: Db) -> None:
    good = insert_with_headers(db, "a", {"tenant": "t-1", "traceparent": TRACEPARENT, "tracestate": "k=v"})
    plain = insert_with_headers(db, "b", None)
    bad = {
        "array": insert_with_headers(db, "c", ["tenant"]),
        "number": insert_with_headers(db, "d", {"tenant": 7}),
        "reserved": insert_with_headers(db, "e", {"outbox_id": "1"}),
        # A consumer would fetch this object in place of the payload (relay.claimcheck).
        "forged reference": insert_with_headers(db, "h", {"dataref": "s3://elsewhere/x", "datadigest": "sha-256=x"}),
        "name": insert_with_headers(db, "f", {"a b": "x"}),
        "empty": insert_with_headers(db, "g", {"tenant": ""}),
    }
    worker, publisher = make_worker(store)
    for _ in range(3):
        await worker.run_once()
    delivered = {m.id: m for m in publisher.delivered}
    assert set(delivered) == {good, plain}  # the neighbours of the bad ones are delivered
    assert delivered[good].headers == {"tenant": "t-1", "traceparent": TRACEPARENT, "tracestate": "k=v"}
    envelope = delivered[good].envelope()
    assert envelope["traceparent"] == TRACEPARENT and envelope["outbox_id"] == good  # unchanged, beside the relay's
    assert delivered[plain].headers is None and "tenant" not in delivered[plain].envelope()
    rows = {r["id"]: r for r in db.rows()}
    reasons = {kind: rows[i]["last_error"] for kind, i in bad.items()}
    assert all(rows[i]["status"] == "dead" for i in bad.values()), reasons
    assert "must be a JSON object" in reasons["array"]
    assert "'tenant' must be a string" in reasons["number"]
    assert "'outbox_id' is one of the relay's own" in reasons["reserved"]
    assert "'dataref' is one of the relay's own" in reasons["forged reference"]
    assert "is not one brokers take" in reasons["name"]
    assert "must be 1 to" in reasons["empty"]
    assert all(r.startswith("the producer's headers are refused") for r in reasons.values())


@pytest.mark.parametrize("name", sorted(RELAY_HEADERS | CLAIM_CHECK_HEADERS))
def test_no_relay_name_can_be_a_producer_header(name: str) -> None:
    with pytest.raises(ValueError, match="one of the relay's own"):
        producer_headers({name: "x"})


def test_the_relays_fields_win_in_the_envelope() -> None:
    # producer_headers refuses the relay's names; the envelope keeps the relay's even so.
    m: OutboxMessage = outbox_message(1, headers={"outbox_id": "forged", "tenant": "t"})
    assert m.envelope()["outbox_id"] == m.id and m.envelope()["tenant"] == "t"


def test_more_attributes_than_aws_allows_is_permanent_for_that_message() -> None:
    from relay.adapters.aws.entries import MAX_ATTRIBUTES, attributes, check
    from relay.errors import PermanentError

    identity = {"event_id": "4d1f0e1e-8f7e-4d3c-9a5b-2f7a8c6d9e10", "aggregate_epoch": "1.1.0a1b2c3d"}
    relay_own = len(attributes(outbox_message(1, ordered=True, aggregate_seq=1, **identity)))
    room = MAX_ATTRIBUTES - relay_own
    assert room == 3  # an ordered message: 7 of the relay's own
    fits = outbox_message(1, ordered=True, aggregate_seq=1, headers={f"h{i}": "v" for i in range(room)}, **identity)
    over = outbox_message(2, ordered=True, aggregate_seq=1, headers={f"h{i}": "v" for i in range(room + 1)}, **identity)
    assert not isinstance(check(fits, max_bytes=262_144, service="SQS", destination="the queue"), PermanentError)
    refused = check(over, max_bytes=262_144, service="SQS", destination="the queue")
    assert isinstance(refused, PermanentError)
    assert f"SQS allows at most {MAX_ATTRIBUTES}" in str(refused) and f"at most {room} producer headers" in str(refused)
