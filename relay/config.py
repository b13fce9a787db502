"""The core's settings: the options `relay start` and the operator commands declare
(the engine that reads them is :mod:`relay.options`), and :class:`RelaySettings`, which
checks them together and builds the worker's configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from relay.adapters.registry import BROKERS
from relay.backoff import Backoff
from relay.claimcheck import ClaimChecks, ClaimCheckSettings
from relay.cloudevents import ENVELOPES, CloudEvents
from relay.contract import PublishLimits
from relay.db.dispatch import DEFAULT_BATCH_BYTES, MAX_BATCH_BYTES, MIN_BATCH_BYTES
from relay.db.names import OutboxNames
from relay.db.session import SessionLimits
from relay.decide import Policy
from relay.errors import ConfigError
from relay.options import DAY, HOUR, MINUTE, MS, SECOND, Option, SizeOption
from relay.ordering import OrderingMap
from relay.routes import DELIVERY_KEYS, Route, Router, parse_routes
from relay.worker import WorkerConfig, lease_margin

CORE_OPTIONS: tuple[Option, ...] = (
    Option(
        "dsn",
        "str",
        None,
        "PostgreSQL connection string or URL of the database holding the outbox.",
        secret=True,
    ),
    Option("schema", "str", "public", "Schema of the outbox table.", nonempty=True),
    Option("table", "str", "outbox", "Name of the outbox table.", nonempty=True),
    Option(
        "outbox",
        "str",
        None,
        "With a config file that lists several outboxes ([[outboxes]]): the one to act on by its name"
        " (relay start: run only it; relay status shows them all without it).",
        metavar="NAME",
        nonempty=True,
    ),
)

# The relay's own sessions (relay start's pool, relay replay's session): its transactions
# last milliseconds, so anything longer is a bug or a stuck network holding locks and the
# xmin horizon, which PostgreSQL then ends (relay.db.SessionLimits).
SESSION_OPTIONS: tuple[Option, ...] = (
    Option(
        "statement_timeout",
        "duration",
        "30s",
        "PostgreSQL cancels a statement of the relay's sessions that runs longer (0s: off).",
        # The relay's statements take milliseconds; a claim or finalize on a table bloated by
        # an outage may take seconds. 30 s leaves room for those and still frees the locks.
        minimum=0,
        maximum=DAY,
    ),
    Option(
        "idle_in_transaction_timeout",
        "duration",
        "10s",
        "PostgreSQL ends a relay session left idle inside a transaction this long (0s: off).",
        # No relay transaction waits for anything but the database; 10 s covers a process
        # starved of CPU, and bounds how long a stuck one keeps its row locks.
        minimum=0,
        maximum=DAY,
    ),
)

START_OPTIONS: tuple[Option, ...] = (
    Option(
        "broker",
        "choice",
        None,
        "Where to deliver: a broker, an HTTP API (http), or log (JSON lines on stdout).",
        choices=BROKERS,
    ),
    Option("workers", "int", 4, "Dispatch loops in this process.", minimum=1, maximum=256),
    Option(
        "batch_size",
        "int",
        100,
        "Rows one claim leases at first, and again after a claim that comes back short.",
        minimum=1,
        maximum=1000,
    ),
    Option(
        "max_batch_size",
        "int",
        400,
        "Rows one claim leases at most while claims come back full (a backlog): each full claim"
        " leases twice as many as the last, up to this (never less than --batch-size).",
        minimum=1,
        maximum=5000,
    ),
    SizeOption(
        "batch_bytes",
        "str",
        DEFAULT_BATCH_BYTES,
        "Payload bytes one claim leases at most (512KiB, 4MiB, 10MB or bytes); a larger message is"
        " claimed alone, one at a time per process.",
        minimum=MIN_BATCH_BYTES,
        maximum=MAX_BATCH_BYTES,
    ),
    Option(
        "lease",
        "duration",
        "60s",
        "How long a claim owns its rows before others may take them over.",
        # Under a second leaves no room for a publish and its finalize; past a day, the rows
        # of a crashed worker wait that long before any other relay may take them over.
        minimum=SECOND,
        maximum=DAY,
    ),
    Option(
        "publish_timeout",
        "duration",
        "20s",
        "Deadline for one batch's publish; must end inside the lease with a margin of 10% (at most 2s).",
        # No broker confirms a batch in under 10 ms: a shorter deadline fails every publish.
        minimum=10 * MS,
        maximum=DAY,
    ),
    Option(
        "poll_interval",
        "duration",
        "1s",
        "How long an idle worker waits before it looks again.",
        # Below 10 ms an idle relay spins (at 0 it commits thousands of empty claims a
        # second); above an hour, without wake-ups, new rows wait that long.
        minimum=10 * MS,
        maximum=HOUR,
    ),
    Option(
        "commit_order_guard",
        "bool",
        None,
        "Deprecated, no effect: ordered events follow commit order whatever the producers lock,"
        " and no other transaction holds them back. Accepted so existing configurations still start.",
    ),
    Option(
        "notify",
        "bool",
        True,
        "Wake idle workers on insert with LISTEN/NOTIFY; turn off behind a transaction-mode pooler.",
    ),
    Option(
        "pipeline",
        "bool",
        True,
        "Claim each worker's next batch while its current one publishes; --no-pipeline claims,"
        " publishes and finalizes one after another.",
    ),
    Option(
        "envelope",
        "choice",
        "relay",
        "What consumers read beside the payload: relay (the relay's own headers), cloudevents"
        " (CloudEvents 1.0, binary mode: ce- headers) or cloudevents-json (structured mode: one"
        " application/cloudevents+json body; the only mode on sqs and sns); not on --broker log.",
        choices=ENVELOPES,
    ),
    Option(
        "cloudevents_source",
        "str",
        None,
        "The CloudEvents source attribute of every event (default urn:outbox-relay:SCHEMA.TABLE).",
        nonempty=True,
    ),
    Option(
        "claim_check_bucket",
        "str",
        None,
        "Store payloads over --claim-check-threshold in this S3-compatible bucket and send a"
        " reference instead (off if unset; needs boto3).",
        nonempty=True,
    ),
    SizeOption(
        "claim_check_threshold",
        "str",
        192 * 1024,
        "Payloads larger than this go to --claim-check-bucket (192 KiB by default: room for the"
        " envelope within SQS's and SNS's 256 KiB).",
        minimum=0,
        maximum=MAX_BATCH_BYTES,
    ),
    Option("claim_check_prefix", "str", "outbox-relay/", "Key prefix of the stored payloads.", nonempty=True),
    Option(
        "claim_check_endpoint_url",
        "str",
        None,
        "The object store's endpoint (MinIO, a moto server, another S3-compatible service); AWS S3 if unset.",
        nonempty=True,
    ),
    Option(
        "claim_check_region", "str", None, "The object store's region (AWS's default chain if unset).", nonempty=True
    ),
    Option("max_attempts", "int", 12, "Claims a message gets before it goes to dead.", minimum=1, maximum=1000),
    Option(
        "backoff_base",
        "duration",
        "1s",
        "First retry waits up to this long (full jitter).",
        # At 0 every retry is immediate, a hot loop against a failing broker.
        minimum=MS,
        maximum=DAY,
    ),
    Option("backoff_cap", "duration", "5m", "No retry waits longer than this.", minimum=MS, maximum=DAY),
    Option(
        "shutdown_grace",
        "duration",
        "10s",
        "On SIGTERM, how long in-flight publishes may finish before they are abandoned.",
        # 0 abandons in-flight publishes at once (their rows go back unspent). Orchestrators
        # kill after 30 s by default; an hour is the most any supervisor waits.
        minimum=0,
        maximum=HOUR,
    ),
    Option(
        "defer_max_age",
        "duration",
        "1d",
        "A message deferred past this age since it was written goes to dead.",
        minimum=SECOND,
        maximum=365 * DAY,
    ),
    Option(
        "ordering_default",
        "choice",
        "ordered",
        "Strategy for event types no ordering rule names.",
        section="ordering",
        key="default",
        choices=("ordered", "unordered"),
    ),
    Option(
        "ordered",
        "list",
        (),
        "Event types (names or globs such as 'Order*') delivered in order per aggregate.",
        section="ordering",
    ),
    Option(
        "unordered",
        "list",
        (),
        "Event types (names or globs) delivered without ordering.",
        section="ordering",
    ),
    *SESSION_OPTIONS,
)
# A route's own envelope and claim-check (relay.routes.DELIVERY_KEYS), parsed as these.
_DELIVERY_OPTIONS = {o.dest: o for o in START_OPTIONS if o.dest in DELIVERY_KEYS}

# `relay migrate --grant-producer/--grant-relay` and `relay grants` (relay.db.grants).
GRANT_OPTIONS: tuple[Option, ...] = (
    Option(
        "grant_producer",
        "list",
        (),
        "Grant this existing role what producers need: INSERT of the producer columns, SELECT of id (repeatable).",
    ),
    Option(
        "grant_relay",
        "list",
        (),
        "Grant this existing role what relays need: DML on the outbox's tables, no DDL (repeatable).",
    ),
)

# --otel (relay.tracing.tracing_for reads it); named so that other commands that publish
# (relay replay) declare the same option.
OTEL_OPTION = Option(
    "otel",
    "bool",
    False,
    "Trace with OpenTelemetry: a span per message (the consumer continues the producer's trace) and per"
    " claim, exported as the OTEL_* variables say; needs pip install 'outbox-relay[otel]'.",
)

OPERATE_OPTIONS: tuple[Option, ...] = (
    Option(
        "metrics_port",
        "int",
        None,
        "Serve /metrics, /healthz and /readyz on this port (off if unset).",
        minimum=0,
        maximum=65535,
    ),
    Option("metrics_host", "str", "0.0.0.0", "Address the metrics endpoint listens on.", nonempty=True),
    Option(
        "prune_older_than",
        "duration",
        None,
        "Delete done rows older than this, on a schedule (off if unset; see relay prune).",
        # A relay deleting rows it finished a moment ago leaves nothing to look at after an
        # incident; a minute is the least that still means "old".
        minimum=MINUTE,
        maximum=36500 * DAY,
    ),
    Option(
        "prune_heads_idle_for",
        "duration",
        None,
        "The scheduled prune also forgets the aggregate_seq counter of every ordered aggregate idle this long"
        " (it starts again at 1 if it comes back; off if unset; see relay prune --heads-idle-for).",
        # A counter forgotten while a consumer still remembers the aggregate's last number
        # makes that consumer drop the restarted sequence as duplicates: never minutes.
        minimum=HOUR,
        maximum=36500 * DAY,
    ),
    Option(
        "prune_interval",
        "duration",
        "1h",
        "How often the scheduled prune runs.",
        # Each run reads at least one chunk; more often than every second is a busy loop.
        minimum=SECOND,
        maximum=7 * DAY,
    ),
    OTEL_OPTION,
)

LOG_OPTIONS: tuple[Option, ...] = (
    Option(
        "log_level",
        "choice",
        "info",
        "debug, info, warning or error.",
        choices=("debug", "info", "warning", "error"),
    ),
    Option("log_format", "choice", "text", "text or json (one object per line).", choices=("text", "json")),
)


@dataclass(frozen=True)
class RelaySettings:
    """Everything `relay start` needs from the core options, validated together."""

    dsn: str
    names: OutboxNames
    broker: str
    workers: int
    worker: WorkerConfig
    ordering: OrderingMap
    shutdown_grace: timedelta = timedelta(seconds=10)
    notify: bool = True
    session: SessionLimits = field(default_factory=SessionLimits)
    # Lines `relay start` logs once as warnings (deprecated options that were given).
    warnings: tuple[str, ...] = ()
    cloudevents: CloudEvents | None = None  # --envelope cloudevents[-json]
    claim_check: ClaimChecks | None = None  # --claim-check-bucket, and the routes' own

    @classmethod
    def from_values(cls, v: Mapping[str, Any], *, broker: str | None = None) -> RelaySettings:
        """The settings of resolved option values ``v``; ``broker`` names the destination
        when the caller brings a publisher of its own (``--broker`` is not read then)."""
        dsn = require_dsn(v)
        broker = broker or require_broker(v)
        lease: timedelta = v["lease"]
        publish_timeout: timedelta = v["publish_timeout"]
        if lease <= timedelta(0):
            raise ConfigError("invalid --lease: must be longer than zero")
        if publish_timeout <= timedelta(0):
            raise ConfigError("invalid --publish-timeout: must be longer than zero")
        if publish_timeout + lease_margin(lease) > lease:
            raise ConfigError(
                f"--publish-timeout ({publish_timeout.total_seconds():g}s) must end inside --lease"
                f" ({lease.total_seconds():g}s) with a margin of 10% (at most 2s): a publish still running"
                " when its lease expires could deliver out of order after another worker took the message over"
            )
        if v["backoff_cap"] < v["backoff_base"]:
            raise ConfigError("--backoff-cap must not be shorter than --backoff-base")
        ordering = ordering_from(v)
        worker = WorkerConfig(
            batch_size=v["batch_size"],
            max_batch_size=max(v["batch_size"], v["max_batch_size"]),
            batch_bytes=v["batch_bytes"],
            lease=lease,
            publish_timeout=publish_timeout,
            poll_interval=v["poll_interval"],
            pipeline=v["pipeline"],
            policy=Policy(
                max_attempts=v["max_attempts"],
                backoff=Backoff(base=v["backoff_base"], cap=v["backoff_cap"]),
                defer_max_age=v["defer_max_age"],
            ),
        )
        names = names_from(v)
        return cls(
            dsn=dsn,
            names=names,
            broker=broker,
            cloudevents=cloudevents_from(v, broker, names),
            claim_check=claim_checks_from(v, broker),
            workers=v["workers"],
            worker=worker,
            ordering=ordering,
            shutdown_grace=v["shutdown_grace"],
            notify=v["notify"],
            session=session_limits(v),
            warnings=_deprecations(v),
        )

    @property
    def publish_limits(self) -> PublishLimits:
        """What the broker adapter is told of the core's settings when it is built."""
        return PublishLimits(
            publish_timeout=self.worker.publish_timeout,
            workers=self.workers,
            batch_size=self.worker.batch_size,
            cloudevents=self.cloudevents,
        )


ORDERING_OPTIONS = tuple(o for o in START_OPTIONS if o.section == "ordering")
# The destinations that write CloudEvents (relay.cloudevents) so far.
CLOUDEVENTS_BROKERS = frozenset({"http", "kafka", "nats", "rabbitmq", "sns", "sqs"})
# Structured mode only: a message carries at most 10 message attributes.
STRUCTURED_ONLY = frozenset({"sns", "sqs"})


def route_values(v: Mapping[str, Any], route: Route, n: int) -> dict[str, Any]:
    """``v`` with route ``n``'s DELIVERY_KEYS over it, each parsed as its option (the
    envelope, the claim-check's bucket, threshold and prefix); one line for a bad value."""
    out = dict(v)
    for key, value in route.delivery.items():
        if key == "claim_check":
            if not isinstance(value, bool):
                raise ConfigError(f"route {n}: claim_check must be true or false")
            continue
        out[key] = _DELIVERY_OPTIONS[key].parse(value, f"route {n}")
    return out


def claim_checks_from(v: Mapping[str, Any], broker: str) -> ClaimChecks | None:
    """The claim-check of every route and of the relay (None: none has a bucket)."""
    default = claim_check_from(v)
    routes = parse_routes(v.get("route") or (), broker)
    each = tuple(
        None if r.delivery.get("claim_check") is False else claim_check_from(route_values(v, r, n))
        for n, r in enumerate(routes, start=1)
    )
    if default is None and not any(each):
        return None
    return ClaimChecks(default, each, Router(routes, has_default=True).route_of)


def claim_check_from(v: Mapping[str, Any]) -> ClaimCheckSettings | None:
    """--claim-check-* as the store takes them; None without a bucket."""
    bucket = v.get("claim_check_bucket")
    if not bucket:
        return None
    return ClaimCheckSettings(
        bucket=str(bucket).strip(),
        threshold=int(v["claim_check_threshold"]),
        prefix=v.get("claim_check_prefix") or "outbox-relay/",
        endpoint_url=v.get("claim_check_endpoint_url"),
        region=v.get("claim_check_region"),
    )


def cloudevents_from(v: Mapping[str, Any], broker: str, names: OutboxNames) -> CloudEvents | None:
    """--envelope and --cloudevents-source as the destination's adapter takes them."""
    envelope = v.get("envelope") or "relay"
    if envelope == "relay":
        return None
    if broker in STRUCTURED_ONLY and envelope == "cloudevents":
        raise ConfigError(
            f"--envelope cloudevents: binary mode puts every attribute in a message attribute, and --broker {broker}"
            " carries at most 10; use --envelope cloudevents-json (structured: the attributes in the body)"
        )
    if broker not in CLOUDEVENTS_BROKERS:
        raise ConfigError(
            f"--envelope {envelope}: --broker {broker} does not write CloudEvents"
            f" ({', '.join(f'--broker {b}' for b in sorted(CLOUDEVENTS_BROKERS))} do)"
        )
    source = v.get("cloudevents_source") or f"urn:outbox-relay:{names.schema}.{names.table}"
    return CloudEvents(source=source, structured=envelope == "cloudevents-json")


def _deprecations(v: Mapping[str, Any]) -> tuple[str, ...]:
    if v.get("commit_order_guard") is None:
        return ()
    return (
        "--commit-order-guard/--no-commit-order-guard (RELAY_COMMIT_ORDER_GUARD, commit_order_guard) is deprecated"
        " and has no effect: ordered events are delivered in commit order whatever the producers lock, and no"
        " transaction elsewhere holds them back; remove the setting",
    )


def ordering_from(v: Mapping[str, Any]) -> OrderingMap:
    """The ordering map from resolved option values (defaults where a value is None)."""
    return OrderingMap(
        default_ordered=(v.get("ordering_default") or "ordered") == "ordered",
        ordered=v.get("ordered") or (),
        unordered=v.get("unordered") or (),
    )


def session_limits(v: Mapping[str, Any]) -> SessionLimits:
    """The relay's session limits from resolved option values (defaults where a value is None)."""
    default = SessionLimits()
    statement, idle = v.get("statement_timeout"), v.get("idle_in_transaction_timeout")
    return SessionLimits(
        statement_timeout=default.statement_timeout if statement is None else statement,
        idle_in_transaction_timeout=default.idle_in_transaction_timeout if idle is None else idle,
    )


def require_broker(v: Mapping[str, Any]) -> str:
    broker = v.get("broker")
    if not broker:
        raise ConfigError(f"no broker chosen: pass --broker ({', '.join(BROKERS)}) or set RELAY_BROKER")
    return str(broker)


def require_dsn(v: Mapping[str, Any]) -> str:
    dsn = v.get("dsn")
    if not dsn:
        raise ConfigError("no database given: pass --dsn, set RELAY_DSN, or put dsn in the config file")
    return str(dsn)


def names_from(v: Mapping[str, Any]) -> OutboxNames:
    # Only a missing value means the default: an empty one was refused when it was parsed,
    # and reaches OutboxNames (which refuses it too) if it was put in by hand.
    schema, table = v.get("schema"), v.get("table")
    return OutboxNames(schema="public" if schema is None else schema, table="outbox" if table is None else table)
