"""`relay start --broker nats` against the local nats-server with JetStream, a stream per
test, read back from the stream: what the stream holds is the oracle.

Delivery, zero duplicates in the stream (every redelivery inside its duplicate_window) and
per-aggregate order with relays SIGKILLed every 1-2 s, for producers that lock the
aggregate and producers that do not (the order oracle is the producers' commit log); a
stream missing at first (nothing dead, no attempt spent, then everything flows); a message
over the server's max_payload (dead alone); subject templates.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter

import pytest
from psycopg import sql

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.deliveries import ORDERED, store_fleet_ordering
from tests.nats_server import NatsStream
from tests.producers import KILLED_RELAYS_RUN, Arrival, order_violations, producers_of_kind
from tests.relay_process import RelayProcess, assert_one_line_error, kill_relays_while, relay_env, run_relay, wait_until


def nats_relay(
    names: OutboxNames, stream: NatsStream, subject: str, *extra: str, env: dict[str, str], relays: list[RelayProcess]
) -> RelayProcess:
    relay = RelayProcess(
        "start", "--schema", names.schema, "--broker", "nats", "--nats-url", stream.url, "--subject", subject,
        "--workers", "2", "--batch-size", "50", "--lease", "5s", "--publish-timeout", "3s",
        "--poll-interval", "100ms", "--backoff-base", "100ms", "--backoff-cap", "500ms", *extra,
        env=env,
    )  # fmt: skip
    relays.append(relay)
    return relay


def test_messages_carry_the_envelope_and_the_event_id_as_nats_msg_id(
    db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    nats_stream.create()
    ids = db.insert((f"order-{i % 3}", "OrderPlaced", {"i": i}) for i in range(9))
    relay = nats_relay(
        db.names, nats_stream, nats_stream.subject("orders"), env=relay_env(RELAY_DSN=relay_dsn), relays=relays
    )
    assert wait_until(lambda: db.settled(9), timeout=30), relay.tail()
    got = nats_stream.read()
    rows = {r["id"]: r for r in db.rows()}
    assert sorted(int(m.headers["outbox_id"]) for m in got) == ids
    for m in got:
        row = rows[int(m.headers["outbox_id"])]
        assert m.headers["Nats-Msg-Id"] == m.headers["event_id"] == str(row["event_id"])
        assert m.subject == nats_stream.subject("orders") and json.loads(m.data) == row["payload"]
    relay.stop()
    relay.assert_clean_exit()


def test_a_redelivery_inside_the_window_is_stored_once_and_a_replay_again(
    db: Db, pg_dsn: str, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    """A relay that published and died before its finalize: the next one publishes the
    same messages again (made here by putting the rows back, as the lease running out
    would), and the stream keeps one copy. A replay carries its run id in its message id,
    so the stream takes it though the window has not passed."""
    nats_stream.create()
    run_relay("migrate", "--dsn", pg_dsn, "--schema", db.names.schema, "--ordering-default", "unordered")
    ids = db.insert((f"order-{i}", "EmailQueued", {"i": i}) for i in range(6))
    env = relay_env(RELAY_DSN=relay_dsn)
    subject = nats_stream.subject("mail")
    relay = nats_relay(db.names, nats_stream, subject, env=env, relays=relays)
    assert wait_until(lambda: db.settled(6), timeout=30), relay.tail()
    relay.stop()
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'pending', available_at = now() WHERE id = ANY(%s)").format(db.table), (ids,)
    )
    again = nats_relay(db.names, nats_stream, subject, env=env, relays=relays)
    assert wait_until(lambda: db.settled(6), timeout=30), again.tail()
    again.stop()
    assert {r["attempts"] for r in db.rows()} == {2}  # published twice
    assert sorted(int(m.headers["outbox_id"]) for m in nats_stream.read()) == ids  # stored once
    replay = run_relay(
        "replay", "--dsn", pg_dsn, "--schema", db.names.schema, "--broker", "nats", "--nats-url", nats_stream.url,
        "--subject", subject, "--from-id", str(ids[0]), "--run-id", "rebuild-1", env=relay_env(),
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    replayed = [m for m in nats_stream.read() if m.headers.get("replay") == "rebuild-1"]
    assert sorted(int(m.headers["outbox_id"]) for m in replayed) == ids
    assert all(m.headers["Nats-Msg-Id"] == m.headers["event_id"] + "-rebuild-1" for m in replayed)


@pytest.mark.parametrize(
    "missing_s", [pytest.param(4, id="4s"), pytest.param(20, id="20s", marks=pytest.mark.extended)]
)
def test_a_missing_stream_holds_messages_unspent_then_everything_flows(
    missing_s: int, db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    db.insert((f"order-{i}", "OrderPlaced", {"i": i}) for i in range(10))
    subject = nats_stream.subject("orders")
    relay = nats_relay(db.names, nats_stream, subject, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    time.sleep(missing_s)
    rows = db.at_rest()
    assert {r["status"] for r in rows} == {"pending"} and {r["attempts"] for r in rows} == {0}, rows
    assert "no JetStream stream captures" in relay.stderr()
    nats_stream.create()
    assert wait_until(lambda: db.settled(10), timeout=30), relay.tail()
    assert {r["attempts"] for r in db.rows()} == {1} and {r["status"] for r in db.rows()} == {"done"}
    assert len(nats_stream.read()) == 10


def test_a_message_over_max_payload_goes_dead_alone(
    db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    nats_stream.create()
    big = {"blob": "x" * 1_100_000}  # over the server's max_payload of 1 MiB
    ids = db.insert([("a", "OrderPlaced", {"n": 1}), ("b", "OrderPlaced", big), ("c", "OrderPlaced", {})])
    relay = nats_relay(
        db.names, nats_stream, nats_stream.subject("o"), env=relay_env(RELAY_DSN=relay_dsn), relays=relays
    )
    assert wait_until(lambda: db.settled(3), timeout=30), relay.tail()
    rows = {r["id"]: r for r in db.rows()}
    assert [rows[i]["status"] for i in ids] == ["done", "dead", "done"]
    assert rows[ids[1]]["attempts"] == 1 and "max_payload" in rows[ids[1]]["last_error"]
    assert sorted(int(m.headers["outbox_id"]) for m in nats_stream.read()) == [ids[0], ids[2]]


def test_a_subject_template_names_each_messages_subject(
    db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    nats_stream.create()
    ids = db.insert([("o1", "OrderPlaced", {}), ("o1", "OrderPaid", {}), ("bad id", "OrderPaid", {})])
    template = nats_stream.prefix + ".{aggregate_type}.{event_type}.{aggregate_id}"
    relay = nats_relay(db.names, nats_stream, template, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: db.settled(3), timeout=30), relay.tail()
    got = {int(m.headers["outbox_id"]): m.subject for m in nats_stream.read()}
    assert got == {
        ids[0]: nats_stream.subject("order", "OrderPlaced", "o1"),
        ids[1]: nats_stream.subject("order", "OrderPaid", "o1"),
    }
    dead = db.row(ids[2])
    assert dead["status"] == "dead" and "subject template" in dead["last_error"]


def test_an_id_that_would_change_the_subjects_tokens_goes_dead_alone_never_to_another_tree(
    db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    """The stream captures ``<prefix>.>``, so any subject under it is stored: an aggregate
    id ``x.y`` in ``<prefix>.{aggregate_id}.ev`` would land in aggregate ``x``'s subtree
    (``<prefix>.x.y.ev``). Each such id is refused alone, naming itself and the template;
    the neighbours are stored under their own subjects."""
    nats_stream.create()
    hostile = ["x.y", "x.*", "x.>", "a\rb", "tab\tid", "", "."]
    ids = db.insert([("x", "OrderPlaced", {})] + [(a, "OrderPlaced", {}) for a in hostile] + [("y", "OrderPaid", {})])
    template = nats_stream.prefix + ".{aggregate_id}.ev"
    relay = nats_relay(db.names, nats_stream, template, env=relay_env(RELAY_DSN=relay_dsn), relays=relays)
    assert wait_until(lambda: db.settled(len(ids)), timeout=30), relay.tail()
    got = {int(m.headers["outbox_id"]): m.subject for m in nats_stream.read()}
    assert got == {ids[0]: nats_stream.subject("x", "ev"), ids[-1]: nats_stream.subject("y", "ev")}
    rows = {r["id"]: r for r in db.rows()}
    for outbox_id in ids[1:-1]:
        row = rows[outbox_id]
        assert row["status"] == "dead" and row["attempts"] == 1, row
        reason = row["last_error"]
        assert ("{aggregate_id}" in reason and "one subject token" in reason) or "empty token" in reason, reason
        assert repr(row["aggregate_id"])[:20] in row["last_error"], row["last_error"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((), "no NATS server"),
        (("--nats-url", "http://x:4222"), "expected nats://HOST:PORT"),
        (("--nats-url", "nats://127.0.0.1:4222"), "no subject"),
        (("--nats-url", "nats://127.0.0.1:4222", "--subject", "orders.{tenant}"), "{tenant} is not one of"),
        (("--nats-url", "nats://127.0.0.1:4222", "--subject", "orders.>"), "wildcards"),
        (("--nats-url", "nats://127.0.0.1:1", "--subject", "orders"), "cannot reach NATS"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(db: Db, pg_dsn: str, args: tuple[str, ...], needle: str) -> None:
    proc = run_relay("start", "--dsn", pg_dsn, "--schema", db.names.schema, "--broker", "nats", *args)
    assert_one_line_error(proc, needle)


# The locked producers' variant runs in make test-all; the unlocked one, the harder order,
# keeps make test within its time.
@pytest.mark.parametrize("kind", [pytest.param("locked", marks=pytest.mark.extended), "unlocked"])
def test_every_committed_event_is_in_the_stream_once_in_order_with_relays_killed(
    kind: str, pg_dsn: str, producer_dsn: str, relay_dsn: str, db: Db, nats_stream: NatsStream,
    relays: list[RelayProcess],
) -> None:  # fmt: skip
    names = db.names
    store_fleet_ordering(pg_dsn, names)
    nats_stream.create()  # duplicate_window 2 minutes: longer than the whole test
    env = relay_env(RELAY_DSN=relay_dsn, RELAY_LOG_LEVEL="warning")
    subject = nats_stream.subject("orders")

    def start() -> None:
        nats_relay(names, nats_stream, subject, "--ordered", ORDERED, "--lease", "3s", "--publish-timeout", "2s",
                   env=env, relays=relays)  # fmt: skip

    start()
    start()
    log, producing = producers_of_kind(pg_dsn, producer_dsn, names, kind, 29, **KILLED_RELAYS_RUN[kind])
    kills = kill_relays_while(producing.is_alive, relays, start, random.Random(29))
    producing.join()
    total = len(db.rows())
    assert wait_until(lambda: db.statuses().get("done", 0) == total, timeout=60), (db.statuses(), relays[-1].tail())

    got = nats_stream.read()
    ids = [int(m.headers["outbox_id"]) for m in got]
    counts = Counter(ids)
    assert set(counts) == {r["id"] for r in db.rows()}
    # Every redelivery fell inside the stream's duplicate window: not one stored twice.
    assert sorted(i for i, n in counts.items() if n > 1) == []
    print(f"\n{kind}: {len(got)} messages in the stream for {total} events, 0 duplicates, {kills} relays killed")
    read = [Arrival(outbox_id, m.headers["aggregate_id"]) for m, outbox_id in zip(got, ids, strict=True)]
    assert order_violations(log.expected(), read) == []


def test_routes_hold_a_subject_no_stream_captures_while_the_others_flow(
    db: Db, relay_dsn: str, nats_stream: NatsStream, relays: list[RelayProcess]
) -> None:
    nats_stream.create()
    orphan = nats_stream.prefix.replace("relay-test.", "relay-orphan.") + ".invoices"
    ids = db.insert([("o1", "OrderPlaced", {}), ("i1", "InvoiceSent", {}), ("o2", "OrderPlaced", {})])
    env = relay_env(RELAY_DSN=relay_dsn)
    relay = nats_relay(
        db.names, nats_stream, nats_stream.subject("orders"), "--route", f"Invoice*={orphan}", env=env, relays=relays
    )
    assert wait_until(lambda: db.statuses().get("done", 0) == 2, timeout=30), relay.tail()
    time.sleep(2)
    invoice = db.row(ids[1])
    assert invoice["status"] == "pending" and invoice["attempts"] == 0, invoice
    assert sorted(int(m.headers["outbox_id"]) for m in nats_stream.read()) == [ids[0], ids[2]]
