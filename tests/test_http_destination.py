"""`relay start --broker http` against real HTTP servers on 127.0.0.1, each in its own
process (tests/http_receiver.py): what the receiver got is the oracle. It verifies every
signature with the `standardwebhooks` package, and applies each Idempotency-Key's effect
once.

Failure classes (2xx, 5xx, 429 with Retry-After, 409, 422, slow answers, resets, 401, a
redirect, a closed port), TLS with a throwaway CA (trustme) and a wrong one, mutual TLS,
signing with rotating secrets that never reach the logs, the rate limit, and delivery and
order with relays SIGKILLed meanwhile for producers that lock the aggregate and producers
that do not.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.conftest import Db
from tests.deliveries import ORDERED, store_fleet_ordering
from tests.http_receiver import SECRET_NEW, SECRET_OLD, Receiver, http_relay
from tests.pg_clusters import free_port
from tests.producers import KILLED_RELAYS_RUN, Arrival, order_violations, producers_of_kind
from tests.relay_process import RelayProcess, kill_relays_while, relay_env, run_relay, wait_until


def test_each_answer_is_sorted_into_its_failure_class(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    script = {
        "Flaky": [{"status": 500, "times": 2, "body": "try later"}],
        "Throttled": [{"status": 429, "times": 1, "retry_after": "2"}],
        "Busy": [{"status": 409, "times": 1}],
        "Invalid": [{"status": 422, "body": "field amount: must be positive " + "x" * 1000}],
        "Slow": [{"status": 200, "times": 1, "delay_s": 2.5}],
        "Reset": [{"reset": True, "times": 1}],
    }
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script), RECEIVER_SECRETS=SECRET_OLD)
    types = ["Ok", "Flaky", "Throttled", "Busy", "Invalid", "Slow", "Reset"]
    db.insert((f"agg-{t}", t, {"n": i}) for i, t in enumerate(types))
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_WEBHOOK_SECRET=SECRET_OLD)
    relay = http_relay(db.names, receiver.url, "--http-timeout", "1s", env=env, relays=relays)
    assert wait_until(lambda: db.settled(len(types)), timeout=40), (db.statuses(), relay.tail())
    rows = {r["event_type"]: r for r in db.rows()}
    got = receiver.requests()

    def attempts(t: str) -> int:
        return int(rows[t]["attempts"])

    assert {t: rows[t]["status"] for t in types} == {**dict.fromkeys(types, "done"), "Invalid": "dead"}
    assert attempts("Ok") == 1
    assert attempts("Flaky") == 3  # two 500s, each an attempt
    assert attempts("Busy") == 2
    assert attempts("Slow") == 2 and attempts("Reset") == 2
    # A Retry-After refunds the attempt, and the next request waits for it.
    assert attempts("Throttled") == 1
    throttled = [r["at"] for r in got if r["event_type"] == "Throttled"]
    assert len(throttled) == 2 and (throttled[1] - throttled[0]).total_seconds() >= 1.9
    # A 4xx is permanent at the first attempt; last_error says the status and the start of the body.
    assert attempts("Invalid") == 1
    error = rows["Invalid"]["last_error"]
    assert "422" in error and "field amount: must be positive" in error and len(error) < 400
    # Every request carried the event's id as its key, the same on every retry, and signed.
    for r in got:
        row = rows[r["event_type"]]
        assert r["idempotency_key"] == str(row["event_id"]) and r["outbox_id"] == row["id"]
        assert r["verified"] is True
        assert r["headers"]["Content-Type"] == "application/json"
        assert json.loads(r["body"]) == row["payload"]
    # The slow answer's effect happened once though the relay sent it twice.
    keys = receiver.query("SELECT idempotency_key FROM effects")
    assert sorted(k for (k,) in keys) == sorted(str(rows[t]["event_id"]) for t in types if t != "Invalid")
    relay.stop()
    relay.assert_clean_exit()


def test_a_closed_port_holds_messages_unspent_until_the_receiver_is_up(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    port, metrics = free_port(), free_port()
    ids = db.insert((f"agg-{i}", "OrderPlaced", {"i": i}) for i in range(5))
    env = relay_env(RELAY_DSN=relay_dsn)
    url = f"http://127.0.0.1:{port}/hooks"
    relay = http_relay(db.names, url, "--metrics-port", str(metrics), env=env, relays=relays)

    def readyz() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/readyz", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except OSError:
            return 0, ""

    assert wait_until(lambda: readyz()[0] == 503, timeout=20), relay.tail()
    assert f"127.0.0.1:{port}" in readyz()[1]
    time.sleep(2)
    rows = db.at_rest()
    assert {r["status"] for r in rows} == {"pending"} and {r["attempts"] for r in rows} == {0}, rows
    receiver = receivers(port=port)
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), (db.statuses(), relay.tail())
    assert {r["attempts"] for r in db.rows()} == {1}
    assert len(receiver.requests()) == 5
    assert wait_until(lambda: readyz()[0] == 200, timeout=20), readyz()
    assert "unreachable" in relay.stderr()


def test_redirects_and_unauthorized_hold_the_destination_without_spending_attempts(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    script = {"Moved": [{"status": 308, "times": 3}], "Locked": [{"status": 401, "times": 2}]}
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(script))
    db.insert([("a", "Moved", {}), ("b", "Locked", {})])
    relay = http_relay(db.names, receiver.url, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: db.settled(2), timeout=40), (db.statuses(), relay.tail())
    assert {r["event_type"]: r["attempts"] for r in db.rows()} == {"Moved": 1, "Locked": 1}
    assert "a redirect to" in relay.stderr() or "308" in relay.stderr()


def test_routes_send_event_types_to_their_own_urls_with_their_own_credentials(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], tmp_path: Path
) -> None:
    crm, billing = receivers(), receivers()
    token = "Bearer crm-" + uuid.uuid4().hex
    crm_headers = tmp_path / "crm-headers"
    crm_headers.write_text(f"Authorization: {token}\n")
    config = tmp_path / "relay.toml"
    config.write_text(f'[[routes]]\nmatch = "Customer*"\nurl = "{crm.url}"\nhttp_header_file = "{crm_headers}"\n')
    db.insert([("c1", "CustomerCreated", {}), ("o1", "OrderPaid", {}), ("c2", "CustomerMoved", {})])
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(db.names, billing.url, "--config", str(config), env=env, relays=relays)
    assert wait_until(lambda: db.settled(3), timeout=20), relay.tail()
    assert sorted(r["event_type"] for r in crm.requests()) == ["CustomerCreated", "CustomerMoved"]
    assert all(r["headers"]["Authorization"] == token for r in crm.requests())
    [paid] = billing.requests()
    assert paid["event_type"] == "OrderPaid" and "Authorization" not in paid["headers"]


def test_a_replay_sends_the_same_key_with_the_replay_header(
    db: Db, pg_dsn: str, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    receiver = receivers(RECEIVER_SECRETS=SECRET_OLD)
    ids = db.insert((f"a{i}", "OrderPlaced", {"i": i}) for i in range(4))
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_WEBHOOK_SECRET=SECRET_OLD)
    relay = http_relay(db.names, receiver.url, env=env, relays=relays)
    assert wait_until(lambda: db.settled(4), timeout=20), relay.tail()
    relay.stop()
    replay = run_relay(
        "replay", "--dsn", pg_dsn, "--schema", db.names.schema, "--broker", "http", "--url", receiver.url,
        "--from-id", str(ids[0]), "--run-id", "rebuild-1",
        env=relay_env(RELAY_WEBHOOK_SECRET=SECRET_OLD),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    got = receiver.requests()
    live, again = got[:4], got[4:]
    assert len(again) == 4 and all(r["verified"] for r in got)
    assert sorted(r["idempotency_key"] for r in again) == sorted(r["idempotency_key"] for r in live)
    assert {r["headers"].get("Relay-Replay") for r in again} == {"rebuild-1"}
    assert "Relay-Replay" not in live[0]["headers"]
    assert len(receiver.query("SELECT 1 FROM effects")) == 4  # the receiver applied each once


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def _pem(tmp: Path, name: str, blob: Any) -> str:
    path = tmp / name
    blob.write_to_path(str(path))
    return str(path)


def test_tls_with_its_ca_delivers_and_with_a_wrong_ca_holds(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], ca: trustme.CA,
    tmp_path: Path,
) -> None:  # fmt: skip
    server = ca.issue_cert("127.0.0.1")
    cert = _pem(tmp_path, "server.pem", server.private_key_and_cert_chain_pem)
    receiver = receivers(RECEIVER_CERT=cert)
    db.insert([("a", "OrderPlaced", {"n": 1})])
    wrong = _pem(tmp_path, "wrong-ca.pem", trustme.CA().cert_pem)
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = http_relay(db.names, receiver.url, "--http-ca-file", wrong, env=env, relays=relays)
    assert wait_until(lambda: "certificate" in relay.stderr().lower(), timeout=20), relay.tail()
    relay.stop()
    [row] = db.rows()
    assert row["status"] == "pending" and row["attempts"] == 0 and receiver.requests() == []
    right = _pem(tmp_path, "ca.pem", ca.cert_pem)
    http_relay(db.names, receiver.url, "--http-ca-file", right, env=env, relays=relays)
    assert wait_until(lambda: db.settled(1), timeout=20)
    assert db.rows()[0]["attempts"] == 1 and len(receiver.requests()) == 1


def test_mutual_tls_sends_the_client_certificate(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], ca: trustme.CA,
    tmp_path: Path,
) -> None:  # fmt: skip
    server = _pem(tmp_path, "server.pem", ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem)
    client = _pem(tmp_path, "client.pem", ca.issue_cert("relay@example.com").private_key_and_cert_chain_pem)
    ca_file = _pem(tmp_path, "ca.pem", ca.cert_pem)
    receiver = receivers(RECEIVER_CERT=server, RECEIVER_CLIENT_CA=ca_file)
    db.insert([("a", "OrderPlaced", {"n": 1})])
    env = relay_env(RELAY_DSN=relay_dsn)
    without = http_relay(db.names, receiver.url, "--http-ca-file", ca_file, env=env, relays=relays)
    time.sleep(3)
    without.stop()
    assert db.rows()[0]["attempts"] == 0 and receiver.requests() == [], db.rows()[0]["last_error"]
    http_relay(db.names, receiver.url, "--http-ca-file", ca_file, "--http-client-cert", client, env=env, relays=relays)
    assert wait_until(lambda: db.settled(1), timeout=20)
    assert len(receiver.requests()) == 1


def test_rotating_secrets_sign_every_request_and_never_reach_the_logs(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], tmp_path: Path
) -> None:
    # The receiver knows only the new secret; the relay signs with both while rotating.
    receiver = receivers(RECEIVER_SECRETS=SECRET_NEW, RECEIVER_SCRIPT=json.dumps({"Bad": [{"status": 400}]}))
    secrets = tmp_path / "secrets"
    secrets.write_text(f"{SECRET_OLD}\n{SECRET_NEW}\n")
    token = "Bearer tok-" + uuid.uuid4().hex
    headers = tmp_path / "headers"
    headers.write_text(f"# the CRM's key\nAuthorization: {token}\n")
    db.insert([(f"a{i}", "OrderPlaced", {"i": i}) for i in range(10)] + [("z", "Bad", {"i": token})])
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="debug")
    relay = http_relay(
        db.names, receiver.url, "--webhook-secret-file", str(secrets), "--http-header-file", str(headers),
        env=env, relays=relays,
    )  # fmt: skip
    assert wait_until(lambda: db.settled(11), timeout=30), relay.tail()
    relay.stop()
    got = receiver.requests()
    assert len(got) == 11 and all(r["verified"] for r in got)
    assert all(r["headers"]["Authorization"] == token for r in got)
    assert all(len(r["headers"]["webhook-signature"].split()) == 2 for r in got)
    output = relay.stdout() + relay.stderr()
    for secret in (SECRET_OLD, SECRET_NEW, SECRET_OLD[6:], SECRET_NEW[6:], token, token[7:]):
        assert secret not in output
    # A flag would put a secret in the process list: there is none.
    refused = subprocess.run(
        [str(Path(sys.executable).with_name("relay")), "start", "--broker", "http", "--webhook-secret", SECRET_OLD],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert refused.returncode == 2 and "No such option" in refused.stderr


def test_the_rate_limit_spaces_requests(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    receiver = receivers()
    db.insert((f"a{i}", "OrderPlaced", {"i": i}) for i in range(30))
    relay = http_relay(db.names, receiver.url, "--http-rate", "20", env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: db.settled(30), timeout=30), relay.tail()
    times = [r["at"] for r in receiver.requests()]
    assert len(times) == 30
    # 30 requests at 20/s: the last at least 29 intervals (1.45 s) after the first.
    assert (times[-1] - times[0]).total_seconds() >= 1.4


def test_a_request_timeout_as_long_as_the_publish_timeout_still_sends_what_need_not_wait(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess]
) -> None:
    """--http-timeout may equal --publish-timeout: no request is then sure to be answered
    before the publish deadline, and only those that would wait for a connection are
    handed back; the first of each lane goes, so the backlog drains, each message once."""
    receiver = receivers()
    db.insert((f"a{i}", "OrderPlaced", {"i": i}) for i in range(12))
    relay = http_relay(
        db.names, receiver.url, "--http-concurrency", "4", "--workers", "1", "--batch-size", "12",
        "--publish-timeout", "1s", "--http-timeout", "1s", env=relay_env(RELAY_DSN=relay_dsn), relays=relays,
    )  # fmt: skip
    assert wait_until(lambda: db.settled(12), timeout=60), relay.tail()
    assert {r["status"] for r in db.rows()} == {"done"}
    assert max(r["attempts"] for r in db.rows()) == 1
    assert len({r["idempotency_key"] for r in receiver.requests()}) == 12


# The rate limit in make test-all: make test keeps the concurrency limit within its time.
@pytest.mark.parametrize("limit", [pytest.param("rate", marks=pytest.mark.extended), "concurrency"])
def test_messages_held_back_by_the_destinations_limits_spend_no_attempt(
    db: Db, relay_dsn: str, receivers: Callable[..., Receiver], relays: list[RelayProcess], limit: str
) -> None:
    """A batch larger than the limit lets through within one publish timeout: the rest are
    handed back unsent, attempt refunded, and go in later batches. (Cut by the deadline
    instead, each was charged an attempt it never used, and with --max-attempts 2 most
    went to dead unsent.)"""
    slow = {"OrderPlaced": [{"status": 200, "delay_s": 0.3}]}  # no "times": every request
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(slow)) if limit == "concurrency" else receivers()
    db.insert((f"a{i}", "OrderPlaced", {"i": i}) for i in range(40))
    extra = ["--http-rate", "10"] if limit == "rate" else ["--http-concurrency", "2"]
    relay = http_relay(
        db.names, receiver.url, *extra, "--workers", "1", "--batch-size", "20", "--publish-timeout", "1s",
        "--http-timeout", "500ms", "--max-attempts", "2", env=relay_env(RELAY_DSN=relay_dsn), relays=relays,
    )  # fmt: skip
    assert wait_until(lambda: db.settled(40), timeout=60), relay.tail()
    rows = db.rows()
    assert {r["status"] for r in rows} == {"done"}, [r["last_error"] for r in rows if r["status"] != "done"]
    assert max(r["attempts"] for r in rows) == 1
    assert len({r["idempotency_key"] for r in receiver.requests()}) == 40
    assert any("not sent to" in (r["last_error"] or "") for r in rows) or "not sent" in relay.tail(), (
        "nothing was held back: the test did not reach the limit"
    )


# The locked producers' variant in make test-all: the unlocked one, the harder order, keeps
# make test within its time.
@pytest.mark.parametrize("kind", [pytest.param("locked", marks=pytest.mark.extended), "unlocked"])
def test_every_committed_event_reaches_the_receiver_once_in_order_with_relays_killed(
    kind: str, pg_dsn: str, producer_dsn: str, relay_dsn: str, db: Db, receivers: Callable[..., Receiver],
    relays: list[RelayProcess],
) -> None:  # fmt: skip
    names = db.names
    store_fleet_ordering(pg_dsn, names)
    # Now and then a 500 or a slow answer, so retries and timeouts happen too.
    flaky = {
        "OrderUpdated": [{"status": 503, "times": 1}],
        "EmailQueued": [{"status": 200, "times": 1, "delay_s": 0.2}],
    }
    receiver = receivers(RECEIVER_SCRIPT=json.dumps(flaky), RECEIVER_SECRETS=SECRET_OLD)
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_WEBHOOK_SECRET=SECRET_OLD, RELAY_LOG_LEVEL="warning")

    def start() -> None:
        http_relay(names, receiver.url, "--ordered", ORDERED, "--lease", "3s", "--publish-timeout", "2s",
                   env=env, relays=relays)  # fmt: skip

    start()
    start()
    log, producing = producers_of_kind(pg_dsn, producer_dsn, names, kind, 27, **KILLED_RELAYS_RUN[kind])
    kills = kill_relays_while(producing.is_alive, relays, start, random.Random(27))
    producing.join()
    total = len(db.rows())
    assert wait_until(lambda: db.statuses().get("done", 0) == total, timeout=60), (db.statuses(), relays[-1].tail())

    effects = receiver.query("SELECT outbox_id, aggregate_id FROM effects ORDER BY applied")
    received = {int(o) for o, _a in effects}
    assert received == {r["id"] for r in db.rows()}
    keys = receiver.query("SELECT idempotency_key, count(*) FROM requests WHERE status = 200 GROUP BY 1")
    assert all(n >= 1 for _k, n in keys) and len(keys) == total
    assert all(r["verified"] for r in receiver.requests())
    applied = [Arrival(int(outbox_id), aggregate) for outbox_id, aggregate in effects]
    assert order_violations(log.expected(), applied) == []
    assert kills >= 3
    for relay in relays:
        relay.close()
