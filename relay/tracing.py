"""Tracing with OpenTelemetry (``relay start --otel``, the ``otel`` extra).

What a caller of the publisher does, the worker as any other (``relay replay`` too)::

    tracing = tracing_for(values)                 # NO_TRACING unless values["otel"]
    with tracing.claim_span(owner=..., limit=...) as span:
        claim = await store.claim(...)
        span.claimed(messages=len(claim.messages), ...)
    sent, spans = tracing.begin_publish(messages)
    try:
        outcomes = await publisher.publish(sent)  # sent carries each span's traceparent
    except BaseException as exc:
        spans.end([exc] * len(sent))
        raise
    spans.end(outcomes)
    ...
    tracing.shutdown()                            # flushes what is still buffered

One PRODUCER span per message, ``outbox publish <event_type>``, child of the row's own
``traceparent`` (W3C, from the producer's headers) when it has a valid one, else of the
current context (a root in the worker); the message sent carries the new span's
``traceparent`` in place of the producer's, and the producer's ``tracestate`` unchanged,
so a consumer continues the same trace. One CLIENT span, ``outbox claim``, per claim that
leased, reaped or failed: an idle relay polling an empty outbox records nothing.

Without ``--otel`` nothing here imports OpenTelemetry, and :data:`NO_TRACING` costs a
method call per batch: no allocation per message, the same list handed back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from relay.contract import Outcome
from relay.decide import failure_class
from relay.dsn import mask
from relay.errors import ConfigError, first_line
from relay.message import OutboxMessage
from relay.routes import DESTINATION_KEYS, MAX_REMEMBERED, Router, default_destination, parse_routes

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.util.types import AttributeValue

INSTALL_HINT = "pip install 'outbox-relay[otel]'"
DEFAULT_SERVICE_NAME = "outbox-relay"
# The exporters OTEL_TRACES_EXPORTER may name; otlp is the specification's default.
EXPORTERS = ("otlp", "console", "none")
# The only OTLP transport the extra installs (opentelemetry-exporter-otlp-proto-http).
OTLP_PROTOCOL = "http/protobuf"
# A span's status description quotes this much of a failure's first line.
MAX_STATUS_CHARS = 300

# messaging.system and messaging.operation.name per broker (semantic conventions 1.3x:
# aws_sqs and aws.sns are spelled so there; log is the relay's own).
SYSTEMS: Mapping[str, tuple[str, str]] = {
    "sqs": ("aws_sqs", "send"),
    "sns": ("aws.sns", "publish"),
    "rabbitmq": ("rabbitmq", "publish"),
    "log": ("log", "write"),
}


# ---- the interface the worker (and relay replay) call


class ClaimSpan(Protocol):
    """Around one claim: ``with tracing.claim_span(...) as span:``, then
    :meth:`claimed` with what it leased. An exception leaving the block marks it failed."""

    def __enter__(self) -> ClaimSpan: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def claimed(self, *, messages: int, unreadable: int = 0, reaped: int = 0, payload_bytes: int = 0) -> None: ...


class PublishSpans(Protocol):
    """The spans of one batch begun by :meth:`Tracing.begin_publish`."""

    def end(self, outcomes: Sequence[Outcome]) -> None:
        """Set each span's status from its message's outcome, in order (None: OK; an
        exception: ERROR, with its failure class as ``error.type``) and end them all."""
        ...


class Tracing(Protocol):
    """What the dispatch path asks of tracing; :data:`NO_TRACING` or :class:`OtelTracing`."""

    enabled: bool

    def claim_span(self, *, owner: str, limit: int, ahead: bool = False) -> ClaimSpan: ...

    def begin_publish(
        self, messages: Sequence[OutboxMessage], *, attributes: Mapping[str, AttributeValue] | None = None
    ) -> tuple[Sequence[OutboxMessage], PublishSpans]:
        """Start one span per message; returns the messages to hand to the publisher (each
        carrying its span's traceparent) and the spans to end with the outcomes.
        ``attributes`` are added to every span (``relay replay`` marks its own)."""
        ...

    def shutdown(self) -> None: ...


# ---- tracing off


class _NoClaim:
    __slots__ = ()

    def __enter__(self) -> _NoClaim:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def claimed(self, *, messages: int, unreadable: int = 0, reaped: int = 0, payload_bytes: int = 0) -> None:
        pass


class _NoSpans:
    __slots__ = ()

    def end(self, outcomes: Sequence[Outcome]) -> None:
        pass


class NoTracing:
    """Tracing off: the messages go out as they came, nothing is recorded."""

    enabled = False
    _claim = _NoClaim()
    _spans = _NoSpans()

    def claim_span(self, *, owner: str, limit: int, ahead: bool = False) -> ClaimSpan:
        return self._claim

    def begin_publish(
        self, messages: Sequence[OutboxMessage], *, attributes: Mapping[str, AttributeValue] | None = None
    ) -> tuple[Sequence[OutboxMessage], PublishSpans]:
        return messages, self._spans

    def shutdown(self) -> None:
        pass


NO_TRACING: Tracing = NoTracing()


# ---- building it


def tracing_for(
    values: Mapping[str, Any],
    *,
    max_envelope_fields: int | None = None,
    provider: TracerProvider | None = None,
) -> Tracing:
    """Tracing as resolved option ``values`` ask: :data:`NO_TRACING` unless ``otel`` is on
    (nothing of OpenTelemetry is imported then); else spans over ``provider``, by default
    one built from the ``OTEL_*`` variables (:func:`provider_from_env`). The destination
    of each event type is read from the broker, routes and default destination in
    ``values``. ``max_envelope_fields``: the broker's limit on what travels beside the
    payload (SQS and SNS take 10 attributes); a message already at it is sent without a
    traceparent rather than refused. ConfigError, one line, without the extra installed."""
    if not values.get("otel"):
        return NO_TRACING
    _require_extra()
    return OtelTracing(
        provider or provider_from_env(),
        destination=destination_attributes(values),
        max_envelope_fields=max_envelope_fields,
    )


def _require_extra() -> None:
    try:
        import opentelemetry.sdk.trace
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        raise ConfigError(f"--otel needs the OpenTelemetry packages, which are not installed: {INSTALL_HINT}") from None


def provider_from_env(env: Mapping[str, str] | None = None) -> TracerProvider:
    """A tracer provider as the standard variables say: ``OTEL_SERVICE_NAME`` (default
    outbox-relay), ``OTEL_TRACES_EXPORTER`` (otlp, the default; console, one JSON line per
    span on stderr, since stdout may be the log broker's; none), each exporter behind a
    BatchSpanProcessor. The OTLP exporter (HTTP/protobuf) reads ``OTEL_EXPORTER_OTLP_*``
    itself, the provider ``OTEL_TRACES_SAMPLER`` and ``OTEL_RESOURCE_ATTRIBUTES``."""
    env = os.environ if env is None else env
    _require_extra()
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()] or ["otlp"]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={unknown[0]!r} is not an exporter the relay has (choose from otlp, console, none)"
        )
    exporters: list[SpanExporter] = []
    if "none" not in names:
        if "otlp" in names:
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            if protocol and protocol.strip() != OTLP_PROTOCOL:
                raise ConfigError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol.strip()!r}: the otel extra exports OTLP over"
                    f" {OTLP_PROTOCOL} only; unset it or set it to {OTLP_PROTOCOL}"
                )
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        if "console" in names:
            import sys

            exporters.append(ConsoleSpanExporter(out=sys.stderr, formatter=lambda s: s.to_json(indent=None) + "\n"))
    resource = Resource.create(
        {SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME, SERVICE_VERSION: _version()}
    )
    provider = TracerProvider(resource=resource)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-relay")
    except PackageNotFoundError:  # a checkout on sys.path, not installed
        return "unknown"


def destination_attributes(values: Mapping[str, Any]) -> Callable[[str], Mapping[str, AttributeValue]]:
    """For each event type, the attributes naming where it goes (``messaging.system``,
    ``messaging.destination.name``, ...) under the broker, routes and default destination of
    resolved option ``values``, remembered per type."""
    broker = str(values.get("broker") or "log")
    routes = parse_routes(values.get("route") or (), broker)
    default = "stdout" if broker == "log" else default_destination(values, broker)
    router = Router(routes, has_default=default is not None)
    remembered: dict[str, Mapping[str, AttributeValue]] = {}

    def attributes(event_type: str) -> Mapping[str, AttributeValue]:
        found = remembered.get(event_type)
        if found is None:
            if len(remembered) >= MAX_REMEMBERED:  # a producer writing a new type per message
                remembered.clear()
            chosen = router.route_of(event_type)
            if chosen is None:
                found = _where(broker, None)
            elif chosen == -1:
                found = _where(broker, default)
            else:
                route = routes[chosen]
                key = next(k for k in route.settings if k in DESTINATION_KEYS)
                found = _where(route.broker, route.settings[key])
            remembered[event_type] = found
        return found

    return attributes


def _where(broker: str, destination: str | None) -> dict[str, AttributeValue]:
    system, operation = SYSTEMS.get(broker, (broker, "send"))
    found: dict[str, AttributeValue] = {
        "messaging.system": system,
        "messaging.operation.type": "send",
        "messaging.operation.name": operation,
    }
    if destination is None:  # no route takes it and no default: it waits (relay.routing)
        return found
    if broker == "sqs":
        found["messaging.destination.name"] = destination.rstrip("/").rsplit("/", 1)[-1]
        found["aws.sqs.queue.url"] = destination
    elif broker == "sns":
        found["messaging.destination.name"] = destination.rsplit(":", 1)[-1]
        found["aws.sns.topic.arn"] = destination
    else:  # an exchange ('' for the default exchange, as the conventions say), or stdout
        found["messaging.destination.name"] = destination
    return found


# ---- tracing on


class OtelTracing:
    """Spans over an OpenTelemetry tracer provider (see the module's docstring)."""

    enabled = True

    def __init__(
        self,
        provider: TracerProvider,
        *,
        destination: Callable[[str], Mapping[str, AttributeValue]],
        max_envelope_fields: int | None = None,
    ) -> None:
        """:param provider: where spans go; :meth:`shutdown` flushes and shuts it down.
        :param destination: the destination attributes of an event type
            (:func:`destination_attributes`).
        :param max_envelope_fields: the broker's limit on envelope fields, if it has one."""
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer: Tracer = provider.get_tracer("outbox-relay", _version())
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        self._destination = destination
        self._max_fields = max_envelope_fields

    def claim_span(self, *, owner: str, limit: int, ahead: bool = False) -> ClaimSpan:
        return _OtelClaim(self._tracer, self._trace, owner, limit, ahead)

    def begin_publish(
        self, messages: Sequence[OutboxMessage], *, attributes: Mapping[str, AttributeValue] | None = None
    ) -> tuple[Sequence[OutboxMessage], PublishSpans]:
        producer = self._trace.SpanKind.PRODUCER
        sent: list[OutboxMessage] = []
        spans: list[Span] = []
        for m in messages:
            parent = None
            if m.headers and "traceparent" in m.headers:
                # An invalid traceparent extracts nothing: the span is a root, and the
                # message then carries the relay's valid one instead.
                parent = self._propagator.extract(m.headers)
            span_attributes: dict[str, AttributeValue] = {
                **self._destination(m.event_type),
                "messaging.message.id": str(m.id),
                "outbox.id": m.id,
                "outbox.attempt": m.attempt,
                "outbox.aggregate_type": m.aggregate_type,
                "outbox.aggregate_id": m.aggregate_id,
                "outbox.event_type": m.event_type,
                "outbox.lease_version": m.lease_version,
                "outbox.ordered": m.ordered,
            }
            if m.aggregate_seq is not None:
                span_attributes["outbox.aggregate_seq"] = m.aggregate_seq
            if attributes:
                span_attributes.update(attributes)
            span = self._tracer.start_span(
                f"outbox publish {m.event_type}", context=parent, kind=producer, attributes=span_attributes
            )
            spans.append(span)
            sent.append(self._carrying(m, span))
        return sent, _OtelSpans(spans, self._trace)

    def _carrying(self, m: OutboxMessage, span: Span) -> OutboxMessage:
        """``m`` with ``span``'s traceparent in its headers (the producer's tracestate and
        every other header unchanged); ``m`` itself where it cannot take one more."""
        context = span.get_span_context()
        if not context.is_valid:  # a span without a valid context (the SDK disabled)
            return m
        # What TraceContextTextMapPropagator.inject writes, without the Context it builds
        # for each message (the tracestate is the producer's own, left as written).
        traceparent = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
        replaces = m.headers is not None and "traceparent" in m.headers
        if not replaces and self._max_fields is not None and len(m.envelope()) >= self._max_fields:
            # One more attribute than SQS/SNS take would send the message to dead: it goes
            # without, and the span says so.
            span.set_attribute("outbox.traceparent_sent", False)
            return m
        headers = dict(m.headers) if m.headers else {}
        headers["traceparent"] = traceparent
        return dataclasses.replace(m, headers=headers)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporters. A collector that is away holds
        this up to the exporter's own timeout (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s)."""
        self._provider.shutdown()


class _OtelSpans:
    __slots__ = ("_spans", "_trace")

    def __init__(self, spans: list[Span], trace: Any) -> None:
        self._spans: list[Span] | None = spans
        self._trace = trace

    def end(self, outcomes: Sequence[Outcome]) -> None:
        spans, self._spans = self._spans, None
        if spans is None:  # ended already
            return
        status, code = self._trace.Status, self._trace.StatusCode
        for n, span in enumerate(spans):
            outcome = outcomes[n] if n < len(outcomes) else NO_OUTCOME
            if outcome is None:
                span.set_status(status(code.OK))
            else:
                # A cancellation (shutdown past its grace) is not a broker's failure class.
                cancelled = isinstance(outcome, asyncio.CancelledError)
                span.set_attribute("error.type", "cancelled" if cancelled else failure_class(outcome))
                span.set_status(status(code.ERROR, _described(outcome)))
            span.end()


# The outcome of a span whose message the caller gave none for (a publisher that returned
# too few is a bug the worker reports; its spans still end).
NO_OUTCOME = RuntimeError("no outcome for this message")


class _OtelClaim:
    __slots__ = ("_ahead", "_counts", "_limit", "_owner", "_started", "_trace", "_tracer")

    def __init__(self, tracer: Tracer, trace: Any, owner: str, limit: int, ahead: bool) -> None:
        self._tracer = tracer
        self._trace = trace
        self._owner = owner
        self._limit = limit
        self._ahead = ahead
        self._started = 0
        self._counts = (0, 0, 0, 0)

    def __enter__(self) -> _OtelClaim:
        self._started = time.time_ns()
        return self

    def claimed(self, *, messages: int, unreadable: int = 0, reaped: int = 0, payload_bytes: int = 0) -> None:
        self._counts = (messages, unreadable, reaped, payload_bytes)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        failed = isinstance(exc, Exception)  # a cancellation is not the claim's failure
        messages, unreadable, reaped, payload_bytes = self._counts
        if not failed and not (messages or unreadable or reaped):
            return  # an empty claim of an idle relay: no span (the poll would flood the backend)
        # Started now with the claim's own start time: only now is it known to be worth one.
        span = self._tracer.start_span(
            "outbox claim",
            kind=self._trace.SpanKind.CLIENT,
            start_time=self._started,
            attributes={
                "db.system.name": "postgresql",
                "outbox.worker": self._owner,
                "outbox.claim.limit": self._limit,
                "outbox.claim.ahead": self._ahead,
                "outbox.claim.messages": messages,
                "outbox.claim.unreadable": unreadable,
                "outbox.claim.reaped": reaped,
                "outbox.claim.payload_bytes": payload_bytes,
            },
        )
        if failed and exc is not None:
            span.set_attribute("error.type", type(exc).__qualname__)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, _described(exc)))
        span.end()


def _described(error: BaseException) -> str:
    """A status description: the error's type and first line, passwords masked, cut."""
    line = first_line(str(error))
    text = mask(f"{type(error).__name__}: {line}" if line else type(error).__name__)
    return text if len(text) <= MAX_STATUS_CHARS else text[: MAX_STATUS_CHARS - 1] + "…"
