"""Routes: which destination each event type is delivered to, when one relay process
feeds several queues, topics or exchanges of its broker.

A route names event types (names or globs, read as the ``[ordering]`` rules read them)
and one destination; the first route whose ``match`` fits an event type wins, and a type
no route matches goes to the broker's default destination (``--queue-url``,
``--topic-arn``, ``--exchange``) when one is set. In the config file::

    [[routes]]
    match = ["Order*", "PaymentCaptured"]
    queue_url = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"

and on the command line (repeatable; the destination is the broker's own kind)::

    --route 'Order*,PaymentCaptured=https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo'

Each route becomes a publisher of its own, built by the broker's adapter from the same
settings with the route's destination put in (see :class:`relay.routing.RoutedPublisher`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.dsn import describe_url
from relay.errors import ConfigError, shown
from relay.globs import glob_matches
from relay.options import Option

# The key that names a destination, and the broker whose destination it is.
DESTINATION_KEYS: Mapping[str, str] = {
    "queue_url": "sqs",
    "topic_arn": "sns",
    "exchange": "rabbitmq",
    "url": "http",
    "topic": "kafka",
    "subject": "nats",
}
# Keys a route may carry beside its destination, and the broker they belong to.
EXTRA_KEYS: Mapping[str, str] = {
    "routing_key": "rabbitmq",
    # An external API's own credentials and signing secrets, per URL.
    "http_header_file": "http",
    "webhook_secret_file": "http",
}
# Keys a route may carry for how its messages are written, over the relay's own settings
# of the same names (relay.config parses their values as those options): its envelope, and
# its claim-check (its own bucket, threshold or prefix; ``claim_check = false``: none).
DELIVERY_KEYS = (
    "envelope",
    "cloudevents_source",
    "claim_check",
    "claim_check_bucket",
    "claim_check_threshold",
    "claim_check_prefix",
)
# The brokers whose destinations one relay process may mix: SQS queues and SNS topics
# share the AWS settings (region, endpoint, credentials); an exchange needs RabbitMQ.
FAMILIES: Mapping[str, frozenset[str]] = {
    "sqs": frozenset({"sqs", "sns"}),
    "sns": frozenset({"sqs", "sns"}),
    "rabbitmq": frozenset({"rabbitmq"}),
    "http": frozenset({"http"}),
    "kafka": frozenset({"kafka"}),
    "nats": frozenset({"nats"}),
    "log": frozenset(),
}
# The option holding each broker's default destination.
DEFAULT_DESTINATION: Mapping[str, str] = {
    "sqs": "queue_url",
    "sns": "topic_arn",
    "rabbitmq": "exchange",
    "http": "url",
    "kafka": "topic",
    "nats": "subject",
}
# Where a message goes when no route takes it and no default destination is set.
NO_DESTINATION = "(no destination)"


def shown_destination(value: str) -> str:
    """A destination as logs, `relay status` and the metrics' label show it: the default
    exchange, whose name is empty, said in words; an HTTP destination's URL without its
    password, query or fragment (a query may carry a key too short for the mask to know)."""
    if not value:
        return "'' (the default exchange)"
    if value.startswith(("http://", "https://")) and any(c in value for c in "?#@"):
        return describe_url(value)
    return value


def default_destination(values: Mapping[str, Any], broker: str) -> str | None:
    """The broker's default destination in resolved option ``values`` (``--queue-url``,
    ``--topic-arn``, ``--exchange``), None when none is set."""
    key = DEFAULT_DESTINATION.get(broker)
    value = values.get(key) if key else None
    return None if value is None else str(value)


@dataclass(frozen=True)
class Route:
    """One route: the event types it takes and the adapter settings of its destination."""

    match: tuple[str, ...]
    broker: str  # whose destination this is: sqs, sns or rabbitmq
    settings: Mapping[str, str]  # the options it sets for its publisher: {"queue_url": ...}
    # Its DELIVERY_KEYS as the table gave them (relay.config parses and checks them).
    delivery: Mapping[str, Any] = field(default_factory=dict)

    @property
    def destination(self) -> str:
        """The destination itself (a queue URL, topic ARN or exchange name), for people."""
        key = next(k for k in self.settings if k in DESTINATION_KEYS)
        return shown_destination(self.settings[key])

    def takes(self, event_type: str) -> bool:
        return any(glob_matches(entry, event_type) for entry in self.match)


@dataclass(frozen=True)
class RoutesOption(Option):
    """``--route MATCH=DESTINATION`` (repeatable; ``RELAY_ROUTE`` with routes separated by
    ``;``) or ``[[routes]]`` tables in the config file. Parsed into raw tables here; which
    keys a table may hold depends on the broker, checked by :func:`parse_routes`."""

    def parse(self, value: Any, source: str) -> Any:
        name = f"{self.flag} (from {source})" if source != "command line" else self.flag
        if isinstance(value, str):
            value = [part for part in value.split(";") if part.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"invalid {name}: expected [[routes]] tables or MATCH=DESTINATION")
        tables: list[dict[str, Any]] = []
        for item in value:
            if isinstance(item, Mapping):
                tables.append(dict(item))
            elif isinstance(item, str):
                tables.append(_from_text(item, name))
            else:
                raise ConfigError(f"invalid {name}: expected [[routes]] tables or MATCH=DESTINATION")
        return tuple(tables)


def _from_text(text: str, name: str) -> dict[str, Any]:
    patterns, sep, destination = text.partition("=")
    match = [p.strip() for p in patterns.split(",") if p.strip()]
    if not sep or not match or not destination.strip():
        raise ConfigError(
            f"invalid {name} {shown(text)}: expected EVENT_TYPES=DESTINATION,"
            " such as 'Order*,PaymentCaptured=QUEUE_URL'"
        )
    return {"match": match, "destination": destination.strip()}


ROUTES_OPTION = RoutesOption(
    "route",
    "list",
    (),
    "Deliver these event types (names or globs) to their own destination: EVENT_TYPES=DESTINATION,"
    " repeatable, first match wins; in the config file, [[routes]] tables.",
    key="routes",
)


def parse_routes(tables: Sequence[Mapping[str, Any]], broker: str) -> tuple[Route, ...]:
    """The routes ``tables`` (as :class:`RoutesOption` parsed them) for ``broker``; one
    :class:`relay.ConfigError` line for a route with no ``match``, no destination or two,
    an unknown key, or a destination another broker would need."""
    routes = []
    for n, table in enumerate(tables, start=1):
        where = f"route {n}"
        unknown = sorted(set(table) - {"match", "destination", *DESTINATION_KEYS, *EXTRA_KEYS, *DELIVERY_KEYS})
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {shown(unknown[0])} (a route has match, one destination, and may set"
                f" {', '.join(DELIVERY_KEYS)})"
            )
        match = table.get("match")
        if isinstance(match, str):
            match = [match]
        if not match or not isinstance(match, list | tuple) or not all(isinstance(m, str) and m.strip() for m in match):
            raise ConfigError(f"{where}: match must list the event types it takes (names or globs such as 'Order*')")
        settings = _destination(table, broker, where)
        broker_of = next(DESTINATION_KEYS[k] for k in settings if k in DESTINATION_KEYS)
        delivery = {k: table[k] for k in DELIVERY_KEYS if k in table}
        routes.append(
            Route(match=tuple(m.strip() for m in match), broker=broker_of, settings=settings, delivery=delivery)
        )
    return tuple(routes)


def _destination(table: Mapping[str, Any], broker: str, where: str) -> dict[str, str]:
    allowed = FAMILIES.get(broker, frozenset())
    if not allowed:
        raise ConfigError(
            f"{where}: --broker {broker} has no destinations to route to;"
            " routes need sqs, sns, rabbitmq, http, kafka or nats"
        )
    named = [k for k in DESTINATION_KEYS if k in table]
    if "destination" in table:  # the command line's form: the started broker's own kind
        if named:
            raise ConfigError(f"{where}: two destinations ({', '.join(['destination', *named])}); give one")
        named = [DEFAULT_DESTINATION[broker]]
        table = {**table, named[0]: table["destination"]}
    if not named:
        keys = " or ".join(k for k, b in DESTINATION_KEYS.items() if b in allowed)
        raise ConfigError(f"{where}: no destination: give {keys}")
    if len(named) > 1:
        raise ConfigError(f"{where}: two destinations ({', '.join(named)}); give one")
    key = named[0]
    for k in (key, *(e for e in EXTRA_KEYS if e in table)):
        owner = DESTINATION_KEYS.get(k) or EXTRA_KEYS[k]
        if owner not in allowed:
            raise ConfigError(
                f"{where}: {k} is a destination of --broker {owner}, and this relay runs --broker {broker}"
            )
    settings: dict[str, str] = {}
    for k in (key, *(e for e in EXTRA_KEYS if e in table)):
        value = table[k]
        if not isinstance(value, str) or (k != "exchange" and not value.strip()):
            raise ConfigError(f"{where}: {k} must be a non-empty string")
        settings[k] = value.strip() if k != "exchange" else value
    return settings


# Event types whose route is remembered: far above what an outbox carries. Longer types
# are matched again each time (linear, relay.globs) rather than kept: the memory held
# stays under about 10 MB whatever length the producers give their event types.
MAX_REMEMBERED = 10_000
MAX_REMEMBERED_CHARS = 1_000


@dataclass
class Router:
    """Which route (or the default destination) takes each event type, remembered per type."""

    routes: tuple[Route, ...]
    has_default: bool
    _chosen: dict[str, int | None] = field(default_factory=dict, repr=False)

    def route_of(self, event_type: str) -> int | None:
        """The index of the first route that takes ``event_type``; -1 for the default
        destination; None when there is no destination for it."""
        if event_type in self._chosen:
            return self._chosen[event_type]
        found = next((i for i, r in enumerate(self.routes) if r.takes(event_type)), None)
        chosen = found if found is not None else (-1 if self.has_default else None)
        if len(event_type) <= MAX_REMEMBERED_CHARS:
            if len(self._chosen) >= MAX_REMEMBERED:  # a producer writing a new type per message
                self._chosen.clear()
            self._chosen[event_type] = chosen
        return chosen


def destination_namer(values: Mapping[str, Any]) -> Callable[[str], str] | None:
    """For `relay status --by-event-type`: where each event type goes under the broker,
    routes and default destination of ``values`` (resolved options); None when no broker
    is set there (the status then has no destination column)."""
    broker = values.get("broker")
    if not broker:
        return None
    routes = parse_routes(values.get("route") or (), broker)
    default = "stdout" if broker == "log" else default_destination(values, broker)
    router = Router(routes, has_default=default is not None)

    def name(event_type: str) -> str:
        chosen = router.route_of(event_type)
        if chosen is None:
            return NO_DESTINATION
        if chosen == -1:
            return shown_destination(str(default))
        return routes[chosen].destination

    return name
