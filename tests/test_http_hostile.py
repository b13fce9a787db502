"""A hostile or careless HTTP receiver against the real `relay start --broker http` and a
receiver process (tests/http_receiver.py): no answer to one message decides another's
outcome, a 2xx is delivered whatever its body does, credentials cannot collide, redirects
never lose a body or carry the static headers to another origin, no answer makes a hot
loop, and no secret (a token inside a static header, a query value of --url) reaches
``last_error``, the log or `relay dead list`. Each reproduces a finding of issue 38."""

from __future__ import annotations

import base64
import itertools
import json
import time
import uuid
from collections.abc import Callable
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from psycopg import sql

from tests.conftest import Db
from tests.http_receiver import SECRET_OLD, Receiver, http_relay
from tests.relay_process import RelayProcess, relay_env, run_relay, wait_until


def insert_with_headers(db: Db, aggregate_id: str, event_type: str, headers: dict[str, str]) -> int:
    """A producer's row carrying its own headers."""
    row = db.producer.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
            " VALUES ('order', %s, %s, '{{\"n\": 1}}', %s::jsonb) RETURNING id"
        ).format(db.table),
        (aggregate_id, event_type, json.dumps(headers)),
    ).fetchone()
    assert row is not None
    return int(row[0])


def by_type(db: Db) -> dict[str, dict[str, Any]]:
    return {r["event_type"]: r for r in db.rows()}


def held(db: Db, event_type: str, needle: str) -> Callable[[], bool]:
    """Whether the row of ``event_type`` is back to pending, no attempt spent, with
    ``needle`` in its last_error: a message held, not charged."""

    def check() -> bool:
        row = by_type(db)[event_type]
        return row["status"] == "pending" and row["attempts"] == 0 and needle in (row["last_error"] or "")

    return check


def test_a_retry_after_that_is_no_number_or_overflows_costs_no_message(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    """Before: `²` passed str.isdigit() and float() raised; a 20-digit value overflowed
    timedelta. Each message went dead as an adapter bug (the whole batch, before
    each_message)."""
    script = {
        "Superscript": [{"status": 503, "times": 1, "retry_after": "²"}],
        "Huge": [{"status": 503, "times": 1, "retry_after": "99999999999999999999"}],
        "Garbage": [{"status": 429, "times": 1, "retry_after": "Mon, 99 Foo 2025 99:99:99 GMT"}],
    }
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    types = ["Superscript", "Huge", "Garbage", *(f"Ok{i}" for i in range(5))]
    db.insert((f"agg-{t}", t, {"t": t}) for t in types)
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(db.names, receiver.url, "--http-retry-after-max", "1s", "--workers", "1", env=env, relays=relays)
    assert wait_until(lambda: db.settled(len(types)), timeout=30), (db.statuses(), relay.tail())
    rows = by_type(db)
    assert {t: r["status"] for t, r in rows.items()} == dict.fromkeys(types, "done"), [
        r["last_error"] for r in rows.values()
    ]
    # An unreadable Retry-After is no Retry-After: a retry, its attempt spent.
    assert rows["Superscript"]["attempts"] == 2 and rows["Garbage"]["attempts"] == 2
    # A huge one is cut to --http-retry-after-max: a deferral, its attempt refunded.
    assert rows["Huge"]["attempts"] == 1
    requests = [r["event_type"] for r in receiver.requests()]
    assert sorted(t for t in requests if t.startswith("Ok")) == [f"Ok{i}" for i in range(5)]
    assert "unclassified" not in relay.stderr() and "Traceback" not in relay.stderr()


def test_a_2xx_whose_body_drips_is_delivered_once(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    """Before: the body was read under the request's deadline and the outcome decided
    after it: the 200 became a retry, sent again (the effect twice, for a receiver without
    idempotency) and, every answer dripping, the row ended dead."""
    script = {"Dripping": [{"status": 200, "body": "accepted, thanks", "drip_s": 4}]}
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    db.insert([("a", "Dripping", {"n": 1}), ("b", "Quick", {"n": 2})])
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(
        db.names, receiver.url, "--http-timeout", "1s", "--max-attempts", "2", env=env, relays=relays
    )  # fmt: skip
    assert wait_until(lambda: db.settled(2), timeout=30), (db.statuses(), relay.tail())
    time.sleep(3)  # a retry, had there been one, would have gone by now
    rows = by_type(db)
    assert rows["Dripping"]["status"] == "done" and rows["Dripping"]["attempts"] == 1, rows["Dripping"]["last_error"]
    assert [r["event_type"] for r in receiver.requests()].count("Dripping") == 1
    assert rows["Quick"]["status"] == "done"


def test_producer_credentials_headers_never_collide_with_url_credentials(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    """Before: a producer's Authorization beside credentials in --url raised aiohttp's
    "Cannot combine AUTHORIZATION header with ... credentials encoded in URL": its message
    dead as an adapter bug (its whole batch, before each_message)."""
    receiver = receivers()
    password = "pw-" + uuid.uuid4().hex[:12]
    url = receiver.url.replace("://", f"://relayuser:{password}@")
    db.insert((f"plain-{i}", "OrderPlaced", {"i": i}) for i in range(5))
    forged = {
        "Authorization": "Bearer producer-" + uuid.uuid4().hex,
        "Proxy-Authorization": "Basic cHJvZHVjZXI6eA==",
        "Cookie": "session=producer-cookie",
        "tenant": "t-1",
    }
    insert_with_headers(db, "forged", "OrderForged", forged)
    relay = http_relay(db.names, url, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: db.settled(6), timeout=30), (db.statuses(), relay.tail())
    assert db.statuses() == {"done": 6}, [r["last_error"] for r in db.rows()]
    got = receiver.requests()
    assert len(got) == 6
    basic = "Basic " + base64.b64encode(f"relayuser:{password}".encode()).decode()
    assert {r["headers"].get("Authorization") for r in got} == {basic}
    [mine] = [r for r in got if r["event_type"] == "OrderForged"]
    assert "Cookie" not in mine["headers"] and "Proxy-Authorization" not in mine["headers"]
    assert mine["headers"]["tenant"] == "t-1"
    assert password not in relay.stderr()


def test_a_redirect_that_would_drop_the_body_holds_the_message(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    """Before, with --http-follow-redirects: the 301 turned the POST into a body-less GET,
    whose 200 marked the event done though its body reached no endpoint."""
    key = "qzk5w"  # too short to be masked literally: it must never be shown at all
    script = {"Moved": [{"status": 301, "times": 1, "location": f"/hooks/get-only?api_key={key}"}]}
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    db.insert([("a", "Moved", {"n": 1})])
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(db.names, receiver.url, "--http-follow-redirects", env=env, relays=relays)
    assert wait_until(held(db, "Moved", "301"), timeout=20), (db.rows(), relay.tail())
    row = by_type(db)["Moved"]
    assert "/hooks/get-only" in row["last_error"] and key not in row["last_error"]
    # Only the POST the 301 answered: no body-less GET went anywhere.
    assert set(receiver.query("SELECT method, path FROM requests")) == {("POST", "/hooks/orders")}
    relay.stop()
    assert key not in relay.stderr()


def test_a_redirect_to_another_origin_gets_nothing(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], tmp_path: Path
) -> None:
    """Before: aiohttp followed the 307 to the other origin, static X-Api-Key and all."""
    other = receivers()
    script = {"Away": [{"status": 307, "times": 1, "location": f"http://127.0.0.1:{other.port}/collect?x=1"}]}
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    headers = tmp_path / "headers"
    api_key = "key-" + uuid.uuid4().hex
    headers.write_text(f"X-Api-Key: {api_key}\n")
    db.insert([("a", "Away", {"n": 1})])
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(
        db.names, receiver.url, "--http-follow-redirects", "--http-header-file", str(headers), env=env, relays=relays
    )  # fmt: skip
    assert wait_until(held(db, "Away", "another origin"), timeout=20), (db.rows(), relay.tail())
    assert f"127.0.0.1:{other.port}/collect" in by_type(db)["Away"]["last_error"]
    assert other.requests() == []
    assert len(receiver.requests()) >= 1
    assert api_key not in relay.stderr()


@pytest.mark.parametrize("status", [307, 308])
def test_a_redirect_that_keeps_method_and_body_on_the_same_origin_is_followed(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], status: int
) -> None:
    script = {"Moved": [{"status": status, "times": 1, "location": "/hooks/v2"}]}
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script), RECEIVER_SECRETS=SECRET_OLD)
    db.insert([("a", "Moved", {"amount": 42})])
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_WEBHOOK_SECRET=SECRET_OLD)
    relay = http_relay(db.names, receiver.url, "--http-follow-redirects", env=env, relays=relays)
    assert wait_until(lambda: db.settled(1), timeout=20), relay.tail()
    [row] = db.rows()
    assert row["status"] == "done" and row["attempts"] == 1
    first, second = receiver.requests()
    assert receiver.query("SELECT method, path FROM requests ORDER BY n") == [
        ("POST", "/hooks/orders"),
        ("POST", "/hooks/v2"),
    ]
    assert json.loads(second["body"]) == {"amount": 42} and second["verified"] is True
    assert second["idempotency_key"] == first["idempotency_key"] == str(row["event_id"])


def test_no_answer_shows_a_token_or_a_query_value(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], tmp_path: Path
) -> None:
    """Before: the mask knew only a static header's whole value, so a 403 echoing the bare
    token of ``Bearer <token>`` was stored and logged as it came; the query of --url came
    back inside the redirect and redirect-loop messages."""
    token = "tok" + uuid.uuid4().hex
    short_key = "qzk5w"  # too short to be masked literally: it must never be shown at all
    long_key = "lk" + uuid.uuid4().hex
    query = f"api_key={short_key}&sig={long_key}"
    script = {
        "Denied": [{"status": 403, "body": f"token {token} is revoked"}],
        "Echoed": [{"status": 422, "body": f"unknown parameter sig={long_key}"}],
        "Looping": [{"status": 307, "location": f"/hooks/orders?{query}"}],
    }
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    headers = tmp_path / "headers"
    headers.write_text(f"Authorization: Bearer {token}\n")
    db.insert([("a", "Denied", {}), ("b", "Echoed", {})])
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="debug")
    url = f"{receiver.url}?{query}"
    relay = http_relay(
        db.names, url, "--http-follow-redirects", "--http-header-file", str(headers), env=env, relays=relays
    )  # fmt: skip
    assert wait_until(lambda: db.settled(2), timeout=20), relay.tail()
    db.insert([("c", "Looping", {})])
    assert wait_until(held(db, "Looping", "redirect"), timeout=20), (db.rows(), relay.tail())
    relay.stop()
    rows = by_type(db)
    assert rows["Denied"]["status"] == "dead" and "403" in rows["Denied"]["last_error"]
    assert rows["Echoed"]["status"] == "dead" and "422" in rows["Echoed"]["last_error"]
    listed = [
        run_relay("dead", "list", "--dsn", relay_dsn, "--schema", db.names.schema, *extra, env=relay_env())
        for extra in ((), ("--json",))
    ]
    assert all(proc.returncode == 0 for proc in listed), [proc.stderr for proc in listed]
    assert "403" in listed[0].stdout + listed[1].stdout
    shown = [r["last_error"] for r in rows.values()] + [relay.stdout(), relay.stderr()]
    shown += [proc.stdout + proc.stderr for proc in listed]
    for text in shown:
        for secret in (token, short_key, long_key):
            assert secret not in text, (secret, text[-2000:])


# A date in the past, read as now like "0", in make test-all (make test keeps its time).
@pytest.mark.parametrize("retry_after", ["0", pytest.param("past date", marks=pytest.mark.extended)])
def test_retry_after_now_is_no_hot_loop(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], retry_after: str
) -> None:
    """Before: 541 requests in 8 s for one message, each with its claim, finalize and log
    line, attempts refunded every time, until --defer-max-age (a day)."""
    value = "0" if retry_after == "0" else formatdate(time.time() - 3600, usegmt=True)
    receiver = receivers(RECEIVER_SCRIPT=json.dumps({"Busy": [{"status": 503, "retry_after": value}]}))
    db.insert([("a", "Busy", {})])
    relay = http_relay(db.names, receiver.url, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: len(receiver.requests()) >= 1, timeout=20), relay.tail()
    time.sleep(4)
    relay.stop()
    times = [r["at"] for r in receiver.requests()]
    # The n-th deferral in a row of the message waits at least 2**(n-1) s (1 s, 2 s;
    # above --backoff-base, 100ms here): about 3 requests in 4 s, where the hot loop made
    # hundreds. A busy machine only makes the gaps longer.
    assert 2 <= len(times) <= 4, len(times)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    assert all(gap >= 0.95 * 2**n for n, gap in enumerate(gaps)), gaps
    [row] = db.rows()
    assert row["attempts"] == 0 and row["status"] == "pending"
