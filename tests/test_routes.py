"""Routes (relay.routes) and the routed publisher (relay.routing): which destination each
event type goes to, bad route settings as one line, and one destination pausing alone."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from relay.compose import compose_start
from relay.db.dispatch import OutboxStore
from relay.errors import BrokerUnavailable, ConfigError, DestinationUnavailable
from relay.message import OutboxMessage
from relay.options import resolve
from relay.routes import ROUTES_OPTION, Router, parse_routes
from relay.routing import RoutedPublisher
from relay.testing import InMemoryPublisher
from tests.conftest import Db
from tests.helpers import make_worker

ORDERS = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"
INVOICES = "https://sqs.eu-west-1.amazonaws.com/123456789012/invoices"
TOPIC = "arn:aws:sns:eu-west-1:123456789012:invoices.fifo"


def message(i: int, event_type: str, aggregate_id: str = "a") -> OutboxMessage:
    return OutboxMessage(
        id=i, aggregate_type="order", aggregate_id=aggregate_id, event_type=event_type, body=b"{}",
        attempt=1, lease_version=1, ordered=False,
    )  # fmt: skip


def routes_from(tables: Any, broker: str = "sqs") -> Any:
    values = resolve([ROUTES_OPTION], {}, {"routes": tables}, {})
    return parse_routes(values["route"], broker)


# ---- which route


def test_the_first_matching_route_wins_and_the_rest_go_to_the_default() -> None:
    routes = routes_from(
        [
            {"match": ["Order*", "PaymentCaptured"], "queue_url": ORDERS},
            {"match": ["OrderPlaced", "Invoice*"], "queue_url": INVOICES},  # OrderPlaced: the first route's
        ]
    )
    router = Router(routes, has_default=True)
    assert [router.route_of(t) for t in ("OrderPlaced", "PaymentCaptured", "InvoiceSent", "EmailSent")] == [0, 0, 1, -1]
    assert Router(routes, has_default=False).route_of("EmailSent") is None
    assert routes[0].destination == ORDERS and routes[1].broker == "sqs"


def test_an_http_routes_destination_is_shown_without_its_password_query_or_fragment() -> None:
    """What logs, `relay status`, readiness and the metrics' labels name an HTTP route by:
    a query value (an API key) shorter than the mask's six characters would be shown in
    every one of them otherwise."""
    [route] = routes_from(
        [{"match": ["Order*"], "url": "https://hook:s3cr3tpw@api.example.com:8443/in?key=ab1#x"}], broker="http"
    )
    assert route.destination == "https://hook@api.example.com:8443/in"


def test_aws_brokers_mix_queues_and_topics_and_the_command_line_form_takes_the_brokers_kind() -> None:
    [queue, topic] = routes_from(
        [{"match": ["Order*"], "queue_url": ORDERS}, {"match": "Invoice*", "topic_arn": TOPIC}]
    )
    assert (queue.broker, topic.broker) == ("sqs", "sns")
    values = resolve([ROUTES_OPTION], {"route": (f"Order*,PaymentCaptured={ORDERS}",)}, {}, {})
    [route] = parse_routes(values["route"], "sqs")
    assert route.match == ("Order*", "PaymentCaptured") and route.settings == {"queue_url": ORDERS}
    values = resolve([ROUTES_OPTION], {}, {}, {"RELAY_ROUTE": f"Order*={ORDERS};Invoice*=invoices"})
    assert [r.settings for r in parse_routes(values["route"], "rabbitmq")] == [
        {"exchange": ORDERS},
        {"exchange": "invoices"},
    ]
    [rabbit] = routes_from(
        [{"match": ["Customer*"], "exchange": "customers", "routing_key": "{event_type}"}], "rabbitmq"
    )
    assert rabbit.settings == {"exchange": "customers", "routing_key": "{event_type}"}


@pytest.mark.parametrize(
    ("tables", "broker", "needle"),
    [
        ([{"queue_url": ORDERS}], "sqs", "route 1: match must list the event types"),
        ([{"match": [], "queue_url": ORDERS}], "sqs", "route 1: match must list"),
        ([{"match": ["A"], "queue_url": ORDERS, "topic_arn": TOPIC}], "sqs", "route 1: two destinations"),
        ([{"match": ["A"]}], "sqs", "route 1: no destination: give queue_url or topic_arn"),
        ([{"match": ["A"], "queue_url": ORDERS, "queue": "x"}], "sqs", "route 1: unknown key 'queue'"),
        ([{"match": ["A"], "queue_url": ORDERS}, {"match": ["B"], "exchange": "x"}], "sqs", "route 2: exchange is a"),
        ([{"match": ["A"], "queue_url": ORDERS}], "rabbitmq", "queue_url is a destination of --broker sqs"),
        ([{"match": ["A"], "queue_url": ORDERS, "routing_key": "k"}], "sqs", "routing_key is a destination of"),
        ([{"match": ["A"], "queue_url": ORDERS}], "log", "--broker log has no destinations"),
        ([{"match": ["A"], "queue_url": " "}], "sqs", "queue_url must be a non-empty string"),
        (["Order*"], "sqs", "expected EVENT_TYPES=DESTINATION"),
        (["=x"], "sqs", "expected EVENT_TYPES=DESTINATION"),
        ("not-a-route", "sqs", "expected EVENT_TYPES=DESTINATION"),
        (7, "sqs", "expected [[routes]] tables"),
    ],
)
def test_bad_routes_are_one_line(tables: Any, broker: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        routes_from(tables, broker)
    assert needle in str(info.value) and "\n" not in str(info.value)


# ---- the routed publisher


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Routed = tuple[RoutedPublisher, InMemoryPublisher, InMemoryPublisher, Clock, list[tuple[str, bool]]]


def routed(refusing: bool = True) -> Routed:
    routes = routes_from([{"match": ["Order*"], "queue_url": ORDERS}, {"match": ["Invoice*"], "queue_url": INVOICES}])
    down = BrokerUnavailable("SQS queue orders unavailable: NonExistentQueue")
    orders = InMemoryPublisher(script=(lambda m: down) if refusing else None)
    invoices = InMemoryPublisher()
    clock = Clock()
    changes: list[tuple[str, bool]] = []
    publisher = RoutedPublisher(Router(routes, has_default=False), [orders, invoices], None, clock=clock)
    publisher.watch_destinations(lambda name, is_open: changes.append((name, is_open)))
    return publisher, orders, invoices, clock, changes


async def test_a_refusing_destination_pauses_alone_and_is_probed_with_one_message() -> None:
    publisher, orders, invoices, clock, changes = routed()
    assert changes == [(ORDERS, False), (INVOICES, False)]  # the metrics start at 0 for each
    batch = [message(1, "OrderPlaced"), message(2, "InvoiceSent"), message(3, "OrderPaid", "b")]
    outcomes = await publisher.publish(batch)
    assert outcomes[1] is None and [m.id for m in invoices.delivered] == [2]
    assert all(isinstance(o, DestinationUnavailable) for o in (outcomes[0], outcomes[2]))
    assert ORDERS in str(outcomes[0]) or "orders" in str(outcomes[0])
    assert len(orders.attempts) == 2 and publisher.health(0).is_open

    # Paused: nothing reaches the refusing destination until its probe is due ...
    outcomes = await publisher.publish(batch)
    assert len(orders.attempts) == 2 and outcomes[1] is None
    assert isinstance(outcomes[0], DestinationUnavailable) and outcomes[0].retry_after.total_seconds() <= 5
    # ... then one message probes it; the other waits unsent.
    clock.now += 5
    await publisher.publish(batch)
    assert len(orders.attempts) == 3

    orders.script = None  # the queue exists now
    clock.now += 10
    outcomes = await publisher.publish(batch)
    assert outcomes[0] is None and not publisher.health(0).is_open
    outcomes = await publisher.publish(batch)
    assert outcomes == [None, None, None]
    # outbox_relay_circuit_open{destination=...}: the refusing one opened and closed once.
    assert changes[2:] == [(ORDERS, True), (ORDERS, False)]


async def test_a_message_without_a_destination_waits_with_one_error_line_per_event_type(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher, *_ = routed(refusing=False)
    for _ in range(3):
        outcomes = await publisher.publish([message(1, "EmailSent"), message(2, "InvoiceSent"), message(3, "SmsSent")])
        assert isinstance(outcomes[0], DestinationUnavailable) and outcomes[1] is None
        assert "no destination for event type 'EmailSent'" in str(outcomes[0])
    lines = [r.getMessage() for r in caplog.records if "no destination for event type" in r.getMessage()]
    assert len(lines) == 2 and "'EmailSent'" in lines[0] and "'SmsSent'" in lines[1]


async def test_a_paused_destination_neither_stops_the_claims_nor_spends_attempts(store: OutboxStore, db: Db) -> None:
    # The worker over a routed publisher: one destination refuses everything, the other
    # takes its messages; the process breaker stays closed; nothing refused goes dead.
    routes = routes_from([{"match": ["Order*"], "queue_url": ORDERS}, {"match": ["Invoice*"], "queue_url": INVOICES}])
    down = BrokerUnavailable("SQS queue orders unavailable: NonExistentQueue")
    orders, invoices = InMemoryPublisher(script=lambda m: down), InMemoryPublisher()
    publisher = RoutedPublisher(Router(routes, has_default=False), [orders, invoices], None)
    worker, _ = make_worker(store, max_attempts=2, publisher=publisher)  # type: ignore[arg-type]
    order_ids = db.insert((f"o-{i}", "OrderPlaced", {}) for i in range(5))
    invoice_ids = db.insert((f"i-{i}", "InvoiceSent", {}) for i in range(5))
    for _ in range(4):
        await worker.run_once()
        db.make_available()
    assert sorted(m.id for m in invoices.delivered) == invoice_ids
    rows = {r["id"]: r for r in db.rows()}
    assert all(rows[i]["status"] == "pending" and rows[i]["attempts"] == 0 for i in order_ids)
    assert not worker.breaker.is_open


def test_the_documented_route_envelopes_and_claim_checks_compose_as_the_page_says(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "destinations" / "routes.md").read_text()
    section = page[page.index("## Each route's envelope and claim-check") :]
    [text] = re.findall(r"```toml\n(.*?)```", section, re.S)
    config = tmp_path / "relay.toml"
    config.write_text(text + '\n[sqs]\nqueue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/rest"\n')
    parts = compose_start({"dsn": "postgresql://relay@db/app", "region": "eu-west-1"}, config=str(config))
    checks = parts.settings.claim_check
    assert checks is not None
    documents, audit, other = (checks.of(t) for t in ("DocumentStored", "AuditLogged", "OrderPlaced"))
    assert documents is not None and (documents.bucket, documents.threshold) == ("documents-payloads", 2048)
    assert audit is None
    assert other is not None and (other.bucket, other.threshold) == ("relay-payloads", 192 * 1024)
    routed = parts.publisher
    assert isinstance(routed, RoutedPublisher)
    documents_queue, audit_queue = (routed._targets[i][0] for i in range(2))
    envelope = documents_queue.settings.cloudevents  # type: ignore[attr-defined]
    assert envelope is not None and (envelope.source, envelope.structured) == ("urn:example:documents", True)
    assert audit_queue.settings.cloudevents is None  # type: ignore[attr-defined]
