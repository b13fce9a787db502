"""``relay start --broker sqs`` with routes, as a real subprocess against PostgreSQL and
moto over HTTP: each message at its destination only, in commit order per aggregate, and
a destination created late pausing only itself."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Db
from tests.producers import Arrival, CommitLog, order_violations, producers_both_ways
from tests.rabbitmq_broker import Rabbit, relay_args
from tests.relay_process import (
    RelayProcess,
    assert_one_line_error,
    relay_env,
    run_relay,
    wait_until,
    wait_until_async,
)
from tests.sqs_server import create_queue, queue_url, receive_all, unique_queue_name


def family(
    pg_dsn: str, producer_dsn: str, db: Db, event_type: str, prefix: str, seed: int, transactions: int
) -> list[CommitLog]:
    """Producers of one event family, both ways (locked aggregates first, the design
    reference's pattern, and unlocked ones), run to the end: their commit logs, the oracles."""
    locked, unlocked, producing = producers_both_ways(
        pg_dsn,
        db.names,
        locked_aggregates=[f"{prefix}-L{i}" for i in range(5)],
        unlocked_aggregates=[f"{prefix}-U{i}" for i in range(3)],
        locked_tx=transactions,
        unlocked_rounds=transactions,
        seeds=(seed, seed + 1),
        locked_options={"event_type": event_type},
        unlocked_options={"event_type": event_type, "unordered_type": None},
        producer_dsn=producer_dsn,
    )
    producing.join()
    return [locked, unlocked]


def assert_commit_order(logs: list[CommitLog], arrivals: list[Arrival]) -> None:
    for log in logs:
        assert order_violations(log.expected(), arrivals) == []


# Long (about 25 s): make test-faults and make test-all run it; make test keeps
# test_one_relay_routes_to_two_queues_and_an_sns_topic for routing end to end.
@pytest.mark.faults
@pytest.mark.extended
def test_routes_send_each_event_type_to_its_queue_and_a_late_queue_pauses_only_itself(
    pg_dsn: str,
    producer_dsn: str,
    relay_dsn: str,
    db: Db,
    moto_endpoint: str,
    sqs_client: Any,
    tmp_path: Path,
    relays: list[RelayProcess],
) -> None:
    orders = create_queue(sqs_client, unique_queue_name(fifo=True))
    invoices = create_queue(sqs_client, unique_queue_name(fifo=True))
    late_name = unique_queue_name(fifo=True)
    late = queue_url(moto_endpoint, late_name)  # created 20 s after the relay starts
    # A fresh outbox orders every event type per aggregate (the stored map's default),
    # whatever its destination.
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[[routes]]\nmatch = ["Order*"]\nqueue_url = "{orders}"\n\n'
        f'[[routes]]\nmatch = ["Invoice*"]\nqueue_url = "{invoices}"\n\n'
        f'[[routes]]\nmatch = ["Shipment*"]\nqueue_url = "{late}"\n'
    )
    # One aggregate whose events span destinations: its shipment waits for the late queue,
    # and the order event behind it waits with it.
    [placed, booked, closed] = db.insert(
        [("mixed-1", "OrderPlaced", {}), ("mixed-1", "ShipmentBooked", {}), ("mixed-1", "OrderClosed", {})]
    )
    env = relay_env(RELAY_ENDPOINT_URL=moto_endpoint, RELAY_REGION="us-east-1")
    relay = RelayProcess(
        "start", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "sqs",
        "--workers", "2", "--poll-interval", "100ms", env=env,
    )  # fmt: skip
    relays.append(relay)
    started = time.monotonic()
    # Producers, locking and not, write Order* events (the first queue) and Invoice* events
    # (the second).
    order_logs = family(pg_dsn, producer_dsn, db, "OrderUpdated", "acct", seed=3, transactions=15)
    invoice_logs = family(pg_dsn, producer_dsn, db, "InvoiceIssued", "inv", seed=5, transactions=10)
    produced = set().union(*(log.ids() for log in (*order_logs, *invoice_logs)))
    assert wait_until(lambda: all(r["status"] == "done" for r in db.rows() if r["id"] in produced), timeout=30), (
        db.statuses(),
        relay.stderr()[-3000:],
    )

    # Before the late queue exists: its destination alone is paused; nothing is dead and
    # no attempt is spent on it; the order event behind the waiting shipment waits too.
    time.sleep(max(0.0, started + 20 - time.monotonic()))
    assert relay.running(), relay.stderr()
    rows = {r["id"]: r for r in db.rows()}
    assert rows[placed]["status"] == "done"
    assert (rows[booked]["status"], rows[booked]["attempts"]) == ("pending", 0)
    assert rows[closed]["status"] == "pending"
    assert "dead" not in db.statuses()
    paused = [line for line in relay.stderr().splitlines() if "unavailable, its messages wait" in line]
    assert len(paused) == 1 and late_name in paused[0], relay.stderr()[-3000:]

    sqs_client.create_queue(QueueName=late_name, Attributes={"FifoQueue": "true"})
    created = time.monotonic()
    assert wait_until(lambda: set(db.statuses()) == {"done"}, timeout=15), db.statuses()
    assert time.monotonic() - created < 8
    relay.stop()
    relay.assert_clean_exit()

    # Each message at its destination only, every id once at least, in commit order.
    by_queue = {url: receive_all(sqs_client, url) for url in (orders, invoices, late)}
    types = {r["id"]: r["event_type"] for r in db.rows()}
    assert {types[m.outbox_id][:5] for m in by_queue[orders]} == {"Order"}
    assert {types[m.outbox_id][:7] for m in by_queue[invoices]} == {"Invoice"}
    assert [m.outbox_id for m in by_queue[late]] == [booked]
    assert {m.outbox_id for q in by_queue.values() for m in q} == set(types)
    for logs, url in ((order_logs, orders), (invoice_logs, invoices)):
        assert_commit_order(logs, [Arrival(m.outbox_id, m.attributes["aggregate_id"]) for m in by_queue[url]])
    assert [m.outbox_id for m in by_queue[orders] if m.attributes["aggregate_id"] == "mixed-1"] == [placed, closed]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--route", "Order*"], "invalid --route 'Order*': expected EVENT_TYPES=DESTINATION"),
        (["--broker", "log", "--route", "A=x"], "--broker log has no destinations"),
    ],
)
def test_bad_routes_on_the_command_line_exit_2_with_one_line(pg_dsn: str, args: list[str], needle: str) -> None:
    base = ["start", "--dsn", pg_dsn]
    # --queue-url only with sqs: another broker refuses it (relay.wiring.refuse_other_destinations).
    broker = [] if "--broker" in args else ["--broker", "sqs", "--queue-url", "http://127.0.0.1:1/000000000000/q"]
    assert_one_line_error(run_relay(*base, *broker, *args, env=relay_env()), needle)


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('[[routes]]\nqueue_url = "http://h/1/q"\n', "route 1: match must list"),
        ('[[routes]]\nmatch = ["A"]\n', "route 1: no destination"),
        (
            '[[routes]]\nmatch = ["A"]\nqueue_url = "http://h/1/q"\ntopic_arn = "arn:aws:sns:x:1:t"\n',
            "two destinations",
        ),
        ('[[routes]]\nmatch = ["A"]\nexchange = "x"\n', "exchange is a destination of --broker rabbitmq"),
        ('[[routes]]\nmatch = ["A"]\nqueue_url = "http://h/1/q"\nqueues = 1\n', "unknown key 'queues'"),
    ],
)
def test_bad_routes_in_the_config_file_exit_2_with_one_line(
    pg_dsn: str, relay_dsn: str, tmp_path: Path, toml: str, needle: str
) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(toml)
    proc = run_relay("start", "--config", str(config), "--dsn", relay_dsn, "--broker", "sqs", env=relay_env())
    assert_one_line_error(proc, needle)


def test_status_by_event_type_shows_each_types_destination(pg_dsn: str, relay_dsn: str, db: Db, tmp_path: Path) -> None:
    orders, topic = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo", "arn:aws:sns:eu-west-1:1:invoices"
    config = tmp_path / "relay.toml"
    config.write_text(
        f'broker = "sqs"\n\n[[routes]]\nmatch = ["Order*"]\nqueue_url = "{orders}"\n\n'
        f'[[routes]]\nmatch = ["Invoice*"]\ntopic_arn = "{topic}"\n'
    )
    db.insert([("a", "OrderPlaced", {}), ("b", "InvoiceIssued", {}), ("c", "EmailSent", {})])
    args = ("status", "--by-event-type", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema)
    proc = run_relay(*args)
    assert proc.returncode == 0, proc.stderr
    lines = {
        line.split()[0]: line for line in proc.stdout.splitlines() if line.strip().startswith(("Order", "Inv", "Em"))
    }
    assert lines["OrderPlaced"].endswith(orders) and lines["InvoiceIssued"].endswith(topic)
    assert lines["EmailSent"].endswith("(no destination)")  # no --queue-url: nowhere to go
    as_json = json.loads(run_relay(*args, "--json").stdout)
    assert {t["event_type"]: t["destination"] for t in as_json["by_event_type"]} == {
        "EmailSent": "(no destination)",
        "InvoiceIssued": topic,
        "OrderPlaced": orders,
    }


async def test_rabbitmq_routes_each_event_family_to_its_exchange_with_its_routing_key(
    pg_dsn: str, producer_dsn: str, relay_dsn: str, db: Db, rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path
) -> None:
    customers, orders = await rabbit.exchange("topic"), await rabbit.exchange("topic")
    customer_q = await rabbit.queue(bind=(customers, "order.#"))
    order_q = await rabbit.queue(bind=(orders, "#"))
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[[routes]]\nmatch = ["Customer*"]\nexchange = "{customers}"\n'
        'routing_key = "{aggregate_type}.{event_type}"\n'
    )
    process = RelayProcess(
        "start", "--config", str(config), *relay_args(relay_dsn, db.names, rabbit.amqp.url), "--exchange", orders,
        "--routing-key", "{event_type}",
    )  # fmt: skip
    relays.append(process)
    logs = await asyncio.to_thread(family, pg_dsn, producer_dsn, db, "CustomerRenamed", "c", 9, 10)
    customer_ids = set().union(*(log.ids() for log in logs))
    order_ids = db.insert([(f"o-{i}", "OrderPlaced", {}) for i in range(5)])
    total = len(db.rows())
    assert await wait_until_async(lambda: db.statuses() == {"done": total}, timeout=30), db.statuses()
    process.stop()
    process.assert_clean_exit()

    to_customers = await rabbit.drain(customer_q, len(customer_ids), timeout=10)
    to_orders = await rabbit.drain(order_q, len(order_ids), timeout=10)
    assert {int(m.headers["outbox_id"]) for m in to_customers} == customer_ids
    assert {m.routing_key for m in to_customers} == {"order.CustomerRenamed"}  # the route's own key
    assert sorted(int(m.headers["outbox_id"]) for m in to_orders) == order_ids  # the default exchange's
    assert {m.routing_key for m in to_orders} == {"OrderPlaced"}
    assert_commit_order(
        logs, [Arrival(int(m.headers["outbox_id"]), str(m.headers["aggregate_id"])) for m in to_customers]
    )


def test_one_relay_routes_to_two_queues_and_an_sns_topic(
    pg_dsn: str,
    producer_dsn: str,
    relay_dsn: str,
    db: Db,
    moto_endpoint: str,
    sqs_client: Any,
    make_topic: Any,
    relays: list[RelayProcess],
    tmp_path: Path,
) -> None:
    orders = create_queue(sqs_client, unique_queue_name(fifo=True))
    rest = create_queue(sqs_client, unique_queue_name(fifo=True))  # the default destination
    invoices = make_topic(fifo=True)  # read through the queue subscribed to it
    config = tmp_path / "relay.toml"
    config.write_text(
        f'[[routes]]\nmatch = ["Order*"]\nqueue_url = "{orders}"\n\n'
        f'[[routes]]\nmatch = ["Invoice*"]\ntopic_arn = "{invoices.arn}"\n\n'
        f'[sqs]\nqueue_url = "{rest}"\nendpoint_url = "{moto_endpoint}"\nregion = "us-east-1"\n'
    )
    relay = RelayProcess(
        "start", "--config", str(config), "--dsn", relay_dsn, "--schema", db.names.schema, "--broker", "sqs",
        "--poll-interval", "100ms", env=relay_env(),
    )  # fmt: skip
    relays.append(relay)
    # Each family's producers, locking and not, on the same aggregates: one ordered sequence
    # per aggregate across the three destinations.
    kinds = ("OrderUpdated", "InvoiceIssued", "EmailQueued")
    logs = {
        kind: family(pg_dsn, producer_dsn, db, kind, "acct", seed=10 * n, transactions=8)
        for n, kind in enumerate(kinds)
    }
    total = len(db.rows())
    assert wait_until(lambda: db.statuses() == {"done": total}, timeout=30), (db.statuses(), relay.stderr()[-2000:])
    relay.stop()
    relay.assert_clean_exit()

    for kind, url in (("OrderUpdated", orders), ("InvoiceIssued", invoices.queue_url), ("EmailQueued", rest)):
        got = receive_all(sqs_client, url)
        assert {m.attributes["event_type"] for m in got} == {kind}, url  # at its destination only
        assert {m.outbox_id for m in got} == set().union(*(log.ids() for log in logs[kind]))
        assert_commit_order(logs[kind], [Arrival(m.outbox_id, m.attributes["aggregate_id"]) for m in got])
