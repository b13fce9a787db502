"""OpenTelemetry (``relay start --otel``, issue 13 item 3): spans recorded by the SDK's
in-memory exporter while the relay runs in-process between a real PostgreSQL and a real
RabbitMQ (and moto's SQS), and the real `relay start` as a subprocess: the span's parent
is the row's traceparent, the traceparent the consumer gets names the span, the
attributes are those listed, a claim span per batch, and without the extra (or without
--otel) nothing of OpenTelemetry is imported."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from psycopg import sql

from relay.adapters.registry import max_envelope_fields
from relay.cli.common import publisher_for
from relay.cli.start import START_ALL
from relay.config import RelaySettings
from relay.db.names import OutboxNames
from relay.errors import ConfigError
from relay.options import resolve
from relay.runner import run_relay
from relay.tracing import NO_TRACING, provider_from_env, tracing_for
from tests.conftest import Db
from tests.helpers import outbox_message
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RELAY, RelayProcess, assert_one_line_error, relay_env, wait_until, wait_until_async
from tests.sqs_server import receive_all

ROOT = Path(__file__).resolve().parent.parent
PRODUCER_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PRODUCER_SPAN = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{PRODUCER_TRACE:032x}-{PRODUCER_SPAN:016x}-01"
TRACESTATE = "vendor=opaque-1, other=x"  # a space after the comma: passed on as written


def insert(db: Db, aggregate_id: str, headers: dict[str, str] | None, payload: str = "{}") -> int:
    """A producer's INSERT with ``headers``, as the producer role."""
    row = db.producer.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
            " VALUES ('order', %s, 'OrderPaid', %s::jsonb, %s::jsonb) RETURNING id"
        ).format(db.table),
        (aggregate_id, payload, None if headers is None else json.dumps(headers)),
    ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def traceparent_of(span: ReadableSpan) -> str:
    """The traceparent a message carries when it names ``span``."""
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def publish_spans(exporter: InMemorySpanExporter) -> dict[int, ReadableSpan]:
    found = [s for s in exporter.get_finished_spans() if s.name.startswith("outbox publish ")]
    by_id = {int(s.attributes["outbox.id"]): s for s in found}  # type: ignore[index, arg-type]
    assert len(by_id) == len(found), "a message got two spans"
    return by_id


def claim_spans(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == "outbox claim"]


async def relay_until(db: Db, values: dict[str, Any], provider: TracerProvider, done: dict[str, int]) -> None:
    """`relay start` in-process as the CLI builds it (settings, the broker's publisher,
    tracing from the option values, over ``provider``) until the outbox's statuses are
    ``done``, then a few idle polls more."""
    settings = RelaySettings.from_values(values)
    publisher = publisher_for(settings.broker, values, settings.publish_limits)
    tracing = tracing_for(values, provider=provider, max_envelope_fields=max_envelope_fields(settings.broker))
    assert tracing is not NO_TRACING
    stop = asyncio.Event()
    task = asyncio.create_task(run_relay(settings, publisher, stop, tracing=tracing))
    try:
        assert await wait_until_async(lambda: db.statuses() == done, timeout=20), db.statuses()
        await asyncio.sleep(0.3)  # idle polls (50 ms apart): they must record no claim span
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)
    tracing.shutdown()


def values_for(relay_dsn: str, names: OutboxNames, **over: Any) -> dict[str, Any]:
    values = resolve(START_ALL, {}, {}, {})
    values.update(dsn=relay_dsn, schema=names.schema, table=names.table, workers=2, otel=True, **over)
    values["poll_interval"] = timedelta(milliseconds=50)
    return values


async def test_rabbitmq_span_per_message_child_of_the_rows_traceparent_and_the_consumer_continues_it(
    relay_dsn: str, names: OutboxNames, db: Db, rabbit: Rabbit, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    traced = insert(db, "o-1", {"tenant": "acme", "traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    plain = insert(db, "o-2", None)
    invalid = insert(db, "o-3", {"traceparent": "00-not-a-trace-01", "tracestate": "k=v"})
    too_big = insert(db, "o-4", None, payload=json.dumps({"pad": "x" * 2000}))  # over --amqp-max-message-size
    values = values_for(
        relay_dsn,
        names,
        broker="rabbitmq",
        amqp_url=rabbit.amqp.url,
        exchange=exchange,
        routing_key="{aggregate_type}.{event_type}",
        amqp_max_message_size=1000,
    )
    await relay_until(db, values, provider, {"done": 3, "dead": 1})
    received = {int(m.headers["outbox_id"]): m for m in await rabbit.drain(queue, 3)}  # type: ignore[arg-type]
    assert set(received) == {traced, plain, invalid}
    by_id = publish_spans(exporter)
    assert set(by_id) == {traced, plain, invalid, too_big}
    rows = {r["id"]: r for r in db.rows()}

    span = by_id[traced]
    assert span.name == "outbox publish OrderPaid" and span.kind == SpanKind.PRODUCER
    assert span.parent is not None and span.parent.is_remote
    assert (span.parent.trace_id, span.parent.span_id) == (PRODUCER_TRACE, PRODUCER_SPAN)
    assert span.context is not None and span.context.trace_id == PRODUCER_TRACE
    assert span.status.status_code == StatusCode.OK
    assert dict(span.attributes or {}) == {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": exchange,
        "messaging.message.id": str(traced),
        "outbox.id": traced,
        "outbox.attempt": 1,
        "outbox.aggregate_type": "order",
        "outbox.aggregate_id": "o-1",
        "outbox.event_type": "OrderPaid",
        "outbox.lease_version": rows[traced]["lease_version"],
        "outbox.ordered": True,
        "outbox.aggregate_seq": 1,
    }
    headers = received[traced].headers
    # The consumer's traceparent names the relay's span, in the producer's trace; the
    # producer's tracestate and other headers arrive as written.
    assert headers["traceparent"] == traceparent_of(span) != TRACEPARENT
    assert headers["tracestate"] == TRACESTATE and headers["tenant"] == "acme"

    # What the README's consumer snippet does: its span continues the same trace.
    consumer = TracerProvider().get_tracer("consumer")
    context = TraceContextTextMapPropagator().extract({k: str(v) for k, v in headers.items()})
    with consumer.start_as_current_span("orders process", context=context, kind=SpanKind.CONSUMER) as child:
        assert child.get_span_context().trace_id == PRODUCER_TRACE
        assert child.parent is not None and child.parent.span_id == span.context.span_id  # type: ignore[attr-defined]

    for row_id in (plain, invalid):  # no traceparent, or one that is not valid: a root span
        root = by_id[row_id]
        assert root.parent is None and root.status.status_code == StatusCode.OK
        assert received[row_id].headers["traceparent"] == traceparent_of(root)
    assert "tracestate" not in received[plain].headers
    assert received[invalid].headers["tracestate"] == "k=v"

    failed = by_id[too_big]
    assert rows[too_big]["status"] == "dead"
    assert failed.status.status_code == StatusCode.ERROR
    assert failed.attributes is not None and failed.attributes["error.type"] == "permanent"
    assert (failed.status.description or "").startswith("PermanentError: message body of")

    # A claim span per batch that leased rows: together they leased each row once, and
    # the idle polls after the outbox drained recorded none.
    claims = claim_spans(exporter)
    assert claims, [s.name for s in exporter.get_finished_spans()]
    assert sum(int(c.attributes["outbox.claim.messages"]) for c in claims) == 4  # type: ignore[index, arg-type]
    assert all(c.attributes["outbox.claim.messages"] for c in claims)  # type: ignore[index]
    assert all(c.kind == SpanKind.CLIENT and c.attributes["outbox.claim.limit"] == 100 for c in claims)  # type: ignore[index]
    # Each publish span started after the claim that leased its row ended.
    first_claim_end = min(c.end_time or 0 for c in claims)
    assert all((s.start_time or 0) >= first_claim_end for s in by_id.values())


async def test_sqs_span_attributes_and_a_message_already_at_ten_attributes_goes_without_a_traceparent(
    relay_dsn: str,
    names: OutboxNames,
    db: Db,
    moto_endpoint: str,
    make_queue: Any,
    sqs_client: Any,
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    url = make_queue(fifo=True, ContentBasedDeduplication="false")
    traced = insert(db, "o-1", {"traceparent": TRACEPARENT})
    # Ordered: 7 attributes of the relay's own, so 2 producer headers leave room for a
    # traceparent and 3 do not (SQS takes 10; one more would send the message to dead).
    room = insert(db, "o-2", {"h1": "a", "h2": "b"})
    full = insert(db, "o-3", {"h1": "a", "h2": "b", "h3": "c"})
    values = values_for(relay_dsn, names, broker="sqs", queue_url=url, endpoint_url=moto_endpoint, region="us-east-1")
    await relay_until(db, values, provider, {"done": 3})
    received = {m.outbox_id: m for m in receive_all(sqs_client, url)}
    assert set(received) == {traced, room, full}
    by_id = publish_spans(exporter)
    span = by_id[traced]
    assert span.parent is not None and span.parent.span_id == PRODUCER_SPAN
    assert received[traced].attributes["traceparent"] == traceparent_of(span)
    attributes = dict(span.attributes or {})
    assert attributes["messaging.system"] == "aws_sqs" and attributes["messaging.operation.name"] == "send"
    assert attributes["messaging.destination.name"] == url.rsplit("/", 1)[-1]
    assert attributes["aws.sqs.queue.url"] == url
    assert received[room].attributes["traceparent"] == traceparent_of(by_id[room])
    assert len(received[room].attributes) == 10
    assert "traceparent" not in received[full].attributes and len(received[full].attributes) == 10
    assert by_id[full].attributes is not None and by_id[full].attributes["outbox.traceparent_sent"] is False
    assert "outbox.traceparent_sent" not in (by_id[room].attributes or {})


async def test_a_publish_that_times_out_or_is_cancelled_at_shutdown_ends_its_spans_as_errors(
    relay_dsn: str, names: OutboxNames, db: Db, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    from relay.testing import STALL, InMemoryPublisher
    from tests.helpers import settings_for

    provider, exporter = spans
    insert(db, "o-1", {"traceparent": TRACEPARENT})
    publisher = InMemoryPublisher(script=lambda m: STALL)  # a broker that never answers
    # Retries at once (a 1 ms backoff): the row is claimed again while the test watches.
    settings = settings_for(
        relay_dsn,
        names,
        workers=1,
        publish_timeout=timedelta(milliseconds=500),
        shutdown_grace=timedelta(0),
        backoff_base=timedelta(milliseconds=1),
        backoff_cap=timedelta(milliseconds=1),
    )
    tracing = tracing_for({"otel": True, "broker": "log"}, provider=provider)

    def ended() -> list[ReadableSpan]:
        return [s for s in exporter.get_finished_spans() if s.name.startswith("outbox publish ")]

    def in_flight() -> bool:
        """A publish stalled and not timed out yet: one more attempt than spans ended."""
        return len(publisher.attempts) > len(ended()) >= 1

    stop = asyncio.Event()
    task = asyncio.create_task(run_relay(settings, publisher, stop, tracing=tracing))
    try:
        assert await wait_until_async(in_flight, timeout=10)  # after one timed out (0.5 s)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=10)
    spans_ = ended()
    assert len(spans_) == len(publisher.attempts) >= 2
    assert all(s.status.status_code == StatusCode.ERROR for s in spans_)
    assert [(s.attributes or {}).get("error.type") for s in spans_] == ["timeout"] * (len(spans_) - 1) + ["cancelled"]
    assert (spans_[0].status.description or "").startswith("RetryableError: publish timed out after 0.5s")
    assert spans_[-1].status.description == "CancelledError"  # shutdown past its grace
    assert all(s.parent is not None and s.parent.span_id == PRODUCER_SPAN for s in spans_)
    # Each attempt carried its own span's traceparent.
    assert [m.headers and m.headers["traceparent"] for m in publisher.attempts] == [traceparent_of(s) for s in spans_]
    assert db.statuses() == {"pending": 1}


def test_tracing_off_hands_back_the_same_list_and_records_nothing() -> None:
    assert tracing_for({"otel": False}) is NO_TRACING
    messages = [outbox_message(1, headers={"traceparent": TRACEPARENT})]
    sent, spans = NO_TRACING.begin_publish(messages)
    assert sent is messages
    spans.end([None])
    with NO_TRACING.claim_span(owner="w", limit=10) as claim:
        claim.claimed(messages=1)


def test_publish_spans_end_with_each_outcome_and_only_once(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    from relay.errors import RetryableError

    provider, exporter = spans
    tracing = tracing_for({"otel": True, "broker": "log"}, provider=provider)
    messages = [outbox_message(1), outbox_message(2), outbox_message(3)]
    sent, publish = tracing.begin_publish(messages, attributes={"outbox.replay": True})
    assert [m.id for m in sent] == [1, 2, 3] and all(m.headers and "traceparent" in m.headers for m in sent)
    assert messages[0].headers is None  # the rows' messages are not changed
    publish.end([None, RetryableError("throttled, password=hunter22 in the text\nsecond line")])
    publish.end([None, None, None])  # a second end changes nothing
    by_id = publish_spans(exporter)
    assert [by_id[i].status.status_code for i in (1, 2, 3)] == [StatusCode.OK, StatusCode.ERROR, StatusCode.ERROR]
    assert by_id[2].attributes is not None and by_id[2].attributes["error.type"] == "retryable"
    assert by_id[2].status.description == "RetryableError: throttled, password=*** in the text"  # masked, one line
    assert by_id[3].status.description == "RuntimeError: no outcome for this message"
    assert all(s.attributes is not None and s.attributes["outbox.replay"] is True for s in by_id.values())
    assert by_id[1].attributes is not None and by_id[1].attributes["messaging.destination.name"] == "stdout"


def test_the_provider_follows_the_otel_variables() -> None:
    provider = provider_from_env({"OTEL_TRACES_EXPORTER": "none"})
    assert provider.resource.attributes["service.name"] == "outbox-relay"
    named = provider_from_env({"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "relay-eu"})
    assert named.resource.attributes["service.name"] == "relay-eu"
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER='zipkin' is not an exporter"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(ConfigError, match="exports OTLP over http/protobuf only"):
        provider_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    provider_from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}).shutdown()
    for p in (provider, named):
        p.shutdown()


# ---- the real `relay start`


def _log_broker_run(relay_dsn: str, names: OutboxNames, db: Db, *flags: str, env: dict[str, str]) -> tuple[str, str]:
    """`relay start --broker log` until the outbox is drained, then SIGTERM; its stdout and stderr."""
    with RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "log", "--workers", "1", *flags,
        env=relay_env(**env),
    ) as process:  # fmt: skip
        assert wait_until(lambda: db.statuses().get("done") == 1, timeout=20), process.tail()
        assert process.stop() == 0, process.tail()
        return process.stdout(), process.stderr()


def test_relay_start_otel_exports_at_exit_and_the_log_broker_carries_the_spans_traceparent(
    relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    insert(db, "o-1", {"traceparent": TRACEPARENT, "tracestate": TRACESTATE})
    # Spans are exported only every minute: those printed were flushed by the shutdown.
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "60000", "PYTHONPROFILEIMPORTTIME": "1"}
    out, err = _log_broker_run(relay_dsn, names, db, "--otel", env=env)
    assert "tracing on" in err
    [line] = out.splitlines()
    delivered = json.loads(line)
    exported = [json.loads(s) for s in err.splitlines() if s.startswith('{"name": "outbox ')]
    [publish] = [s for s in exported if s["name"] == "outbox publish OrderPaid"]
    assert [s["name"] for s in exported].count("outbox claim") == 1
    assert publish["parent_id"] == f"0x{PRODUCER_SPAN:016x}"
    assert publish["context"]["trace_id"] == f"0x{PRODUCER_TRACE:032x}"
    assert publish["resource"]["attributes"]["service.name"] == "outbox-relay"
    span_id = publish["context"]["span_id"].removeprefix("0x")
    assert re.fullmatch(rf"00-{PRODUCER_TRACE:032x}-{span_id}-01", delivered["traceparent"]), delivered
    assert delivered["tracestate"] == TRACESTATE
    assert _imported(err, "opentelemetry")  # the check below could not fail without this


def test_without_otel_relay_start_imports_nothing_of_opentelemetry(relay_dsn: str, names: OutboxNames, db: Db) -> None:
    insert(db, "o-1", {"traceparent": TRACEPARENT})
    out, err = _log_broker_run(relay_dsn, names, db, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert json.loads(out)["traceparent"] == TRACEPARENT  # passed through unchanged
    assert _imported(err, "relay.worker") and not _imported(err, "opentelemetry")


def _imported(importtime: str, package: str) -> bool:
    """Whether ``python -X importtime`` output (PYTHONPROFILEIMPORTTIME) shows ``package``."""
    names = (line.rsplit("|", 1)[-1].strip() for line in importtime.splitlines() if line.startswith("import time:"))
    return any(n == package or n.startswith(package + ".") for n in names)


# The console script with the extra made unimportable, as if it were not installed.
WITHOUT_OTEL = (
    "import sys; sys.modules['opentelemetry'] = None; sys.argv[0] = 'relay'; from relay.cli.main import main; main()"
)


@pytest.mark.parametrize("source", ["flag", "variable", "config"])
def test_otel_without_the_extra_is_one_line_naming_the_install(
    relay_dsn: str, names: OutboxNames, tmp_path: Path, source: str
) -> None:
    args = ["start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "log"]
    env = relay_env()
    if source == "flag":
        args.append("--otel")
    elif source == "variable":
        env["RELAY_OTEL"] = "1"
    else:
        config = tmp_path / "relay.toml"
        config.write_text("otel = true\n")
        args += ["--config", str(config)]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL, *args], capture_output=True, text=True, timeout=30, env=env, cwd=ROOT
    )
    assert_one_line_error(proc, "--otel needs the OpenTelemetry packages", "pip install 'outbox-relay[otel]'")


def test_an_unknown_exporter_is_one_line(relay_dsn: str, names: OutboxNames) -> None:
    proc = subprocess.run(
        [RELAY, "start", "--dsn", relay_dsn, "--schema", names.schema, "--broker", "log", "--otel"],
        capture_output=True,
        text=True,
        timeout=30,
        env=relay_env(OTEL_TRACES_EXPORTER="jaeger"),
    )
    assert_one_line_error(proc, "OTEL_TRACES_EXPORTER='jaeger'", "otlp, console, none")
