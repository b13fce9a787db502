"""Prometheus metrics of one relay process, on a registry of its own.

The dispatch loop reports what it does through the methods of :class:`RelayMetrics`
(counts by event type and outcome, lost leases, claim and publish latency, the circuit
breaker); :meth:`RelayMetrics.refresh_gauges` reads the outbox's state with the queries
of `relay status` (partial indexes only, never the done history).

A process serving several outboxes (relay.fleet) labels every series with ``outbox``, the
name its config gives each (a few hundred at most); a process serving one has no such
label, as before. Label values are bounded: outcomes and failure classes come from fixed sets, and event
types, which come from the producers' data, are capped at ``max_event_types`` distinct
values per process (the rest are counted as ``other``). Ids never become labels.

Every relay process exports the same table-wide gauges; aggregate them with ``max``, not
``sum``, across instances (see docs/operations.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.message import KINDS, Decision
from relay.summary import StatusSummary, read_summary

# The `outcome` label: what became of a message, as relay.message.Decision names it.
OUTCOMES: Final = KINDS

# Failure classes of relay.errors and the relay's own verdicts, for outbox_relay_failures_total.
FAILURE_CLASSES: Final = (
    "retryable",
    "permanent",
    "defer",
    "broker_unavailable",
    "timeout",
    "unclassified",
    "lease_expired",
)

# Distinct event types one process labels before folding the rest into "other": far above
# what a real outbox carries, far below what would hurt Prometheus if a producer bug wrote
# a fresh event type per message.
MAX_EVENT_TYPES = 200
OTHER = "other"
# The destination label of the process's own circuit breaker.
ALL_DESTINATIONS = "all"

# Claims are one short statement: milliseconds normally, seconds when the database struggles.
CLAIM_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Publishes of a batch run up to the publish timeout (20 s by default), so the buckets reach past it.
PUBLISH_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)

QUEUE_STATUSES: Final = ("pending", "processing", "dead")

_M = TypeVar("_M", Counter, Gauge, Histogram)


class RelayMetrics:
    """The relay's series on ``registry`` (a new :class:`CollectorRegistry` unless given).

    Safe to call from every worker of a process: prometheus_client's metrics are thread-safe
    and these methods do not await.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_event_types: int = MAX_EVENT_TYPES,
        outboxes: bool = False,
    ) -> None:
        """``outboxes``: the process serves several outboxes (relay.fleet), and every
        series carries an ``outbox`` label; report through :meth:`for_outbox`."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self.max_event_types = max_event_types
        self._event_types: set[str] = set()
        # The outbox label's value in this view (None: the process's single outbox, no label).
        self._outbox: dict[str, str] = {}
        by = ["outbox"] if outboxes else []
        r = self.registry
        self.messages_total = Counter(
            "outbox_relay_messages",
            "Messages finalized, by event type and outcome (published, retried, deferred, dead, released,"
            " broker_unavailable).",
            [*by, "event_type", "outcome"],
            registry=r,
        )
        self.failures_total = Counter(
            "outbox_relay_failures",
            "Failed publishes by event type and failure class.",
            [*by, "event_type", "error_class"],
            registry=r,
        )
        self.lost_leases_total = Counter(
            "outbox_relay_lost_leases",
            "Finalize writes refused because another claim had taken the message over (the lease ran out).",
            by,
            registry=r,
        )
        self.reaped_total = Counter(
            "outbox_relay_reaped",
            "Messages whose lease expired on their last attempt and were sent to dead by the reaper.",
            by,
            registry=r,
        )
        self.claim_seconds = Histogram(
            "outbox_relay_claim_seconds", "Time one claim transaction took.", by, buckets=CLAIM_BUCKETS, registry=r
        )
        self.publish_seconds = Histogram(
            "outbox_relay_publish_seconds", "Time one batch's publish took.", by, buckets=PUBLISH_BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "outbox_relay_queue_depth", "Unfinished messages in the outbox, by status.", [*by, "status"], registry=r
        )
        self.expired_leases = Gauge(
            "outbox_relay_expired_leases",
            "Messages still processing whose lease has run out (their worker stalled or died).",
            by,
            registry=r,
        )
        self.oldest_pending_age = Gauge(
            "outbox_relay_oldest_pending_age_seconds",
            "Age of the oldest message awaiting delivery (pending or processing); 0 when none waits.",
            by,
            registry=r,
        )
        self.dead_messages = Gauge("outbox_relay_dead_messages", "Messages in dead status.", by, registry=r)
        self.blocked_aggregates = Gauge(
            "outbox_relay_blocked_aggregates",
            "Ordered aggregates whose head message is dead, so nothing behind it moves.",
            by,
            registry=r,
        )
        self.circuit_open = Gauge(
            "outbox_relay_circuit_open",
            '1 while a circuit breaker is open, else 0: destination="all" is the process\'s (the broker'
            " refuses everything), a route's destination its own (relay.routing).",
            [*by, "destination"],
            registry=r,
        )
        self.unroutable_routing_keys = Gauge(
            "outbox_relay_unroutable_routing_keys",
            "Routing keys (RabbitMQ) that reach no queue now (312 NO_ROUTE): their messages wait, no attempt spent.",
            by,
            registry=r,
        )
        self.gauges_refreshed = Gauge(
            "outbox_relay_gauges_refreshed_timestamp_seconds",
            "When the outbox gauges were last read from the database (Unix time).",
            by,
            registry=r,
        )
        # Only where there are several outboxes to hold one of.
        self.outbox_held = (
            Gauge(
                "outbox_relay_outbox_held",
                "1 while an outbox of a process serving several is held (its run failed and waits to start"
                " again, or its start waits for its database), else 0.",
                by,
                registry=r,
            )
            if outboxes
            else None
        )
        if not outboxes:
            self._zeros()

    def for_outbox(self, name: str) -> RelayMetrics:
        """This registry's series as one outbox of several reports them (``outbox=name``)."""
        view = copy.copy(self)
        view._outbox = {"outbox": name}
        view._zeros()
        return view

    def _zeros(self) -> None:
        # Export zeros from the start, so rate() and increase() see the first event.
        for status in QUEUE_STATUSES:
            self.queue_depth.labels(**self._outbox, status=status)
        self.circuit_open.labels(**self._outbox, destination=ALL_DESTINATIONS).set(0)
        if self._outbox:
            # An outbox's own series, which a process of one outbox has from the start too.
            unlabelled = (
                self.lost_leases_total,
                self.reaped_total,
                self.claim_seconds,
                self.publish_seconds,
                self.expired_leases,
                self.oldest_pending_age,
                self.dead_messages,
                self.blocked_aggregates,
                self.unroutable_routing_keys,
                self.gauges_refreshed,
            )
            for metric in unlabelled:
                metric.labels(**self._outbox)
            if self.outbox_held is not None:
                self.outbox_held.labels(**self._outbox).set(0)

    def _one(self, metric: _M) -> _M:
        """``metric``'s series for this view's outbox (the metric itself without the label)."""
        return metric.labels(**self._outbox) if self._outbox else metric

    def event_type_label(self, event_type: str) -> str:
        """``event_type`` itself, or ``other`` once ``max_event_types`` distinct ones were seen."""
        if event_type in self._event_types:
            return event_type
        if len(self._event_types) >= self.max_event_types:
            return OTHER
        self._event_types.add(event_type)
        return event_type

    def messages(self, event_type: str, outcome: str, n: int = 1) -> None:
        """Count ``n`` messages of ``event_type`` finalized with ``outcome`` (one of :data:`OUTCOMES`)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}: expected one of {', '.join(OUTCOMES)}")
        self.messages_total.labels(**self._outbox, event_type=self.event_type_label(event_type), outcome=outcome).inc(n)

    def decisions(self, decisions: Iterable[Decision], refused: Iterable[int] = ()) -> None:
        """Count a finalized batch: each decision whose write was not refused (see
        :meth:`relay.db.dispatch.OutboxStore.finalize`); each refused id is a lost lease."""
        lost = set(refused)
        for d in decisions:
            if d.message.id in lost:
                self.lost_lease()
            else:
                self.messages(d.message.event_type, d.kind)

    def failure(self, event_type: str, error_class: str, n: int = 1) -> None:
        """Count ``n`` failed publishes of ``event_type`` by class (one of :data:`FAILURE_CLASSES`)."""
        if error_class not in FAILURE_CLASSES:
            raise ValueError(f"unknown failure class {error_class!r}: expected one of {', '.join(FAILURE_CLASSES)}")
        self.failures_total.labels(
            **self._outbox, event_type=self.event_type_label(event_type), error_class=error_class
        ).inc(n)

    def lost_lease(self, n: int = 1) -> None:
        """Count finalize writes refused by the fence."""
        self._one(self.lost_leases_total).inc(n)

    def reaped(self, n: int = 1) -> None:
        """Count messages the reaper sent to dead (lease expired on the last attempt)."""
        self._one(self.reaped_total).inc(n)

    def observe_claim(self, seconds: float) -> None:
        """Record how long one claim took."""
        self._one(self.claim_seconds).observe(seconds)

    def observe_publish(self, seconds: float) -> None:
        """Record how long one batch's publish took."""
        self._one(self.publish_seconds).observe(seconds)

    def set_circuit_open(self, is_open: bool, destination: str = ALL_DESTINATIONS) -> None:
        """Export a circuit breaker's state (1 open, 0 closed): the process's by default,
        else one destination's."""
        self.circuit_open.labels(**self._outbox, destination=destination).set(1 if is_open else 0)

    def set_destination_open(self, destination: str, is_open: bool) -> None:
        """:class:`relay.routing.DestinationHealth`'s callback."""
        self.set_circuit_open(is_open, destination)

    def watch_unroutable(self, count: Callable[[], int]) -> None:
        """Read ``outbox_relay_unroutable_routing_keys`` from ``count`` at each scrape
        (:class:`relay.contract.ReportsUnroutable`); 0 until this is called."""
        self._one(self.unroutable_routing_keys).set_function(lambda: float(count()))

    def set_status(self, summary: StatusSummary) -> None:
        """Set the outbox gauges from a status summary."""
        self.queue_depth.labels(**self._outbox, status="pending").set(summary.pending)
        self.queue_depth.labels(**self._outbox, status="processing").set(summary.processing)
        self.queue_depth.labels(**self._outbox, status="dead").set(summary.dead)
        self._one(self.expired_leases).set(summary.expired_leases)
        self._one(self.oldest_pending_age).set(summary.oldest_waiting_age_s or 0.0)
        self._one(self.dead_messages).set(summary.dead)
        self._one(self.blocked_aggregates).set(summary.blocked_aggregates)
        self._one(self.gauges_refreshed).set(summary.at.timestamp())

    def set_held(self, held: bool) -> None:
        """Export whether this view's outbox is held (a process serving several)."""
        if self.outbox_held is not None:
            self._one(self.outbox_held).set(1 if held else 0)

    async def refresh_gauges(self, conn: Conn, names: OutboxNames) -> StatusSummary:
        """Read the outbox's state (the `relay status` summary) and set the gauges from it."""
        summary = await read_summary(conn, names)
        self.set_status(summary)
        return summary
