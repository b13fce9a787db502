"""Prometheus metrics and the /metrics, /healthz, /readyz endpoint, over real HTTP and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, fields

import psycopg
import pytest
from prometheus_client import REGISTRY

from relay import httpd
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.httpd import ReadyCheck, all_ready, database_check, pool_check, serve
from relay.message import KINDS, Decision, OutboxMessage
from relay.metrics import OUTCOMES, RelayMetrics
from relay.ordering import OrderingMap
from relay.worker import WorkerStats
from tests.conftest import Db
from tests.ops_helpers import build_scene

MakeStore = Callable[..., Awaitable[OutboxStore]]

SERIES = (
    "outbox_relay_messages_total",
    "outbox_relay_failures_total",
    "outbox_relay_lost_leases_total",
    "outbox_relay_reaped_total",
    "outbox_relay_claim_seconds_bucket",
    "outbox_relay_claim_seconds_count",
    "outbox_relay_publish_seconds_bucket",
    "outbox_relay_publish_seconds_sum",
    'outbox_relay_queue_depth{status="pending"}',
    'outbox_relay_queue_depth{status="processing"}',
    'outbox_relay_queue_depth{status="dead"}',
    "outbox_relay_expired_leases",
    "outbox_relay_oldest_pending_age_seconds",
    "outbox_relay_dead_messages",
    "outbox_relay_blocked_aggregates",
    "outbox_relay_circuit_open",
    "outbox_relay_unroutable_routing_keys",
)


def message(i: int, event_type: str = "OrderPaid") -> OutboxMessage:
    return OutboxMessage(
        id=i,
        aggregate_type="order",
        aggregate_id=f"o{i}",
        event_type=event_type,
        body=b"{}",
        attempt=1,
        lease_version=1,
        ordered=True,
    )


def test_one_outcome_vocabulary_for_decisions_stats_and_metrics() -> None:
    # A Decision's kind is the WorkerStats counter and the metric label it feeds, as spelled.
    assert set(KINDS) <= {f.name for f in fields(WorkerStats)}
    assert OUTCOMES == KINDS
    m = message(1)
    made = [
        Decision.published(m),
        Decision.retry(m, 1.0, "x"),
        Decision.defer(m, 1.0, "x"),
        Decision.dead(m, "x"),
        Decision.released(m),
        Decision.broker_unavailable(m, 1.0, "x"),
    ]
    assert {d.kind for d in made} == set(KINDS)


def test_counters_by_event_type_and_outcome() -> None:
    m = RelayMetrics()
    assert m.registry is not REGISTRY  # a registry of its own, never the global one
    m.messages("OrderPaid", "published", n=3)
    m.messages("OrderPaid", "retried")
    m.messages("OrderPaid", "deferred")
    m.decisions([Decision.published(message(1)), Decision.dead(message(2), "boom")], refused=[2])
    m.failure("OrderPaid", "permanent")
    m.reaped()
    m.observe_claim(0.004)
    m.observe_publish(0.2)
    m.set_circuit_open(True)

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert value("outbox_relay_messages_total", event_type="OrderPaid", outcome="published") == 4
    assert value("outbox_relay_messages_total", event_type="OrderPaid", outcome="retried") == 1
    assert value("outbox_relay_messages_total", event_type="OrderPaid", outcome="deferred") == 1
    assert value("outbox_relay_messages_total", event_type="OrderPaid", outcome="dead") is None  # refused: lost
    assert value("outbox_relay_lost_leases_total") == 1
    assert value("outbox_relay_failures_total", event_type="OrderPaid", error_class="permanent") == 1
    assert value("outbox_relay_reaped_total") == 1
    assert value("outbox_relay_claim_seconds_count") == 1
    assert value("outbox_relay_publish_seconds_bucket", le="0.25") == 1
    assert value("outbox_relay_circuit_open", destination="all") == 1
    m.set_destination_open("https://sqs.example/1/orders", True)  # a route's own breaker
    assert value("outbox_relay_circuit_open", destination="https://sqs.example/1/orders") == 1
    assert value("outbox_relay_circuit_open", destination="all") == 1
    assert value("outbox_relay_unroutable_routing_keys") == 0  # exported before any publisher reports
    held = ["exchange 'x' routing key 'a'", "exchange 'x' routing key 'b'"]
    m.watch_unroutable(lambda: len(held))  # read at each scrape
    assert value("outbox_relay_unroutable_routing_keys") == 2
    held.clear()
    assert value("outbox_relay_unroutable_routing_keys") == 0
    with pytest.raises(ValueError, match="unknown outcome"):
        m.messages("OrderPaid", "exploded")
    with pytest.raises(ValueError, match="unknown failure class"):
        m.failure("OrderPaid", "cosmic rays")


def test_event_type_labels_are_bounded() -> None:
    m = RelayMetrics(max_event_types=2)
    for event_type in ("A", "B", "C", "D", "A"):
        m.messages(event_type, "published")
    labels = {
        s.labels["event_type"] for metric in m.registry.collect() for s in metric.samples if "event_type" in s.labels
    }
    assert labels == {"A", "B", "other"}
    assert (
        m.registry.get_sample_value("outbox_relay_messages_total", {"event_type": "other", "outcome": "published"}) == 2
    )


async def test_refresh_gauges_reads_the_outbox(make_store: MakeStore, db: Db, relay_dsn: str) -> None:
    store = await make_store(OrderingMap(default_ordered=True, unordered=("Email*",)))
    await build_scene(store, db)
    m = RelayMetrics()
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        summary = await m.refresh_gauges(conn, db.names)

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(name, labels)

    assert value("outbox_relay_queue_depth", status="pending") == 6
    assert value("outbox_relay_queue_depth", status="processing") == 2
    assert value("outbox_relay_queue_depth", status="dead") == 1
    assert value("outbox_relay_expired_leases") == 1
    assert value("outbox_relay_dead_messages") == 1
    assert value("outbox_relay_blocked_aggregates") == 1
    age = value("outbox_relay_oldest_pending_age_seconds")
    assert age is not None and age == summary.oldest_waiting_age_s and age > 0


@dataclass
class Endpoint:
    url: str
    metrics: RelayMetrics


@pytest.fixture
async def endpoint_for() -> AsyncIterator[Callable[[ReadyCheck], Awaitable[Endpoint]]]:
    servers: list[asyncio.Server] = []

    async def start(ready: ReadyCheck) -> Endpoint:
        metrics = RelayMetrics()
        server = await serve(0, metrics.registry, ready, host="127.0.0.1")
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return Endpoint(f"http://127.0.0.1:{port}", metrics)

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def fetch(url: str, method: str = "GET", accept: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body) of a real HTTP request, made from a thread."""

    def get() -> tuple[int, str, str]:
        request = urllib.request.Request(url, method=method, headers={"Accept": accept} if accept else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.headers["Content-Type"], err.read().decode()

    return await asyncio.to_thread(get)


async def test_metrics_endpoint_serves_the_named_series(
    endpoint_for: Callable[[ReadyCheck], Awaitable[Endpoint]], names: OutboxNames, relay_dsn: str
) -> None:
    ep = await endpoint_for(database_check(relay_dsn, names))
    ep.metrics.messages("OrderPaid", "published")
    ep.metrics.failure("OrderPaid", "retryable")
    ep.metrics.lost_lease()
    ep.metrics.reaped()
    ep.metrics.observe_claim(0.01)
    ep.metrics.observe_publish(0.1)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        await ep.metrics.refresh_gauges(conn, names)

    status, content_type, body = await fetch(ep.url + "/metrics")
    assert status == 200
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    for series in SERIES:
        assert f"\n{series}" in body, series
    assert 'outbox_relay_messages_total{event_type="OrderPaid",outcome="published"} 1.0' in body

    status, content_type, body = await fetch(ep.url + "/metrics", accept="application/openmetrics-text")
    assert status == 200 and content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")

    assert await fetch(ep.url + "/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
    assert await fetch(ep.url + "/readyz") == (200, "text/plain; charset=utf-8", "ready\n")
    assert (await fetch(ep.url + "/nope"))[0] == 404
    assert (await fetch(ep.url + "/metrics", method="POST"))[0] == 405
    status, _, body = await fetch(ep.url + "/healthz", method="HEAD")
    assert (status, body) == (200, "")


async def test_readyz_fails_when_the_database_is_unreachable(
    endpoint_for: Callable[[ReadyCheck], Awaitable[Endpoint]], names: OutboxNames
) -> None:
    ep = await endpoint_for(database_check("postgresql://u:secretpw@127.0.0.1:1/x", names))
    status, _, body = await fetch(ep.url + "/readyz")
    assert status == 503
    assert body.startswith("not ready: database: cannot connect to PostgreSQL at host 127.0.0.1:1 database 'x'")
    assert len(body.strip().splitlines()) == 1
    assert "secretpw" not in body
    assert (await fetch(ep.url + "/healthz"))[0] == 200  # alive all the same


async def test_readyz_fails_on_a_missing_table_a_slow_check_and_a_crashing_one(
    endpoint_for: Callable[[ReadyCheck], Awaitable[Endpoint]],
    relay_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = await endpoint_for(database_check(relay_dsn, OutboxNames(schema="no_such_schema_here")))
    status, _, body = await fetch(missing.url + "/readyz")
    assert status == 503 and "UndefinedTable" in body

    async def slow() -> tuple[bool, str]:
        await asyncio.sleep(5)
        return True, "late"

    monkeypatch.setattr(httpd, "READY_TIMEOUT_S", 0.2)
    hanging = await endpoint_for(slow)
    assert await fetch(hanging.url + "/readyz") == (
        503,
        "text/plain; charset=utf-8",
        "not ready: readiness check did not answer within 0.2s\n",
    )

    async def broker_down() -> tuple[bool, str]:
        raise RuntimeError("amqp://guest:hunter2@broker:5672/ refused\nsecond line")

    async def fine() -> tuple[bool, str]:
        return True, "broker reachable"

    crashing = await endpoint_for(all_ready(fine, broker_down))
    status, _, body = await fetch(crashing.url + "/readyz")
    assert status == 503 and "hunter2" not in body and "amqp://guest:***@broker" in body
    assert len(body.strip().splitlines()) == 1


async def test_pool_check(pool: object, names: OutboxNames) -> None:
    check = pool_check(pool, names)  # type: ignore[arg-type]
    assert await check() == (True, "database reachable")
    assert (await all_ready(check, check)()) == (True, "database reachable; database reachable")
