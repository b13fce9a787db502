"""Where the core meets the adapters: the brokers' options and the publisher a run uses.

With the CLI (relay.cli) and the embedded relay (relay.embed), the only modules that import
the adapters (through adapters.registry, which imports a broker's adapter only when that
broker is chosen).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from relay.adapters.registry import broker_options, create_publisher, options_by_broker
from relay.config import (
    CORE_OPTIONS,
    GRANT_OPTIONS,
    LOG_OPTIONS,
    OPERATE_OPTIONS,
    START_OPTIONS,
    cloudevents_from,
    names_from,
    route_values,
)
from relay.contract import Publisher, PublishLimits
from relay.errors import ConfigError
from relay.operator_options import OPERATOR_OPTIONS
from relay.options import source_of
from relay.routes import (
    FAMILIES,
    ROUTES_OPTION,
    Route,
    Router,
    default_destination,
    parse_routes,
    shown_destination,
)
from relay.routing import RoutedPublisher

BROKER_OPTIONS = broker_options()
# Every option `relay start` takes (and relay.Relay): one list, one validation.
START_ALL = (*CORE_OPTIONS, *START_OPTIONS, ROUTES_OPTION, *OPERATE_OPTIONS, *LOG_OPTIONS, *BROKER_OPTIONS)
# Every declared setting, whichever command reads it: the keys a config file may hold (one
# file serves relay start and the operator commands alike).
ALL_OPTIONS = (*START_ALL, *GRANT_OPTIONS, *OPERATOR_OPTIONS)
# Every RELAY_* variable some command reads: each option's that reads one, --config's
# RELAY_CONFIG, and the console's token (relay.cli.console.TOKEN_ENV), which is no option:
# it never goes through a flag. A variable not in here is reported
# (relay.options.unknown_variables).
VARIABLES = frozenset({o.env for o in ALL_OPTIONS if o.reads_env} | {"RELAY_CONFIG", "RELAY_CONSOLE_TOKEN"})
# The brokers whose adapters take each broker option (the AWS region: sqs and sns).
_TAKEN_BY: dict[str, frozenset[str]] = {
    o.dest: frozenset(b for b, own in options_by_broker().items() if o in own) for o in BROKER_OPTIONS
}


def refuse_other_destinations(broker: str, cli: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """Refuse an option of another broker's destination given on the command line (or to
    ``Relay(...)``) or in a ``RELAY_*`` variable: ``--queue-url`` with ``--broker rabbitmq``
    would be ignored, and the relay deliver somewhere its operator did not mean. The brokers
    one relay may mix through its routes (SQS and SNS) take each other's options. A config
    file is not held to it: one file may keep the tables of several brokers, and only the
    chosen broker's is read."""
    allowed = {broker, *FAMILIES.get(broker, ())}
    for o in BROKER_OPTIONS:
        owners = _TAKEN_BY[o.dest]
        if owners & allowed:
            continue
        given = source_of(o, cli, {}, env)
        if given is None:
            continue
        named = o.flag if given.source == "command line" else f"{given.source} ({o.flag})"
        choose = " or ".join(f"--broker {b}" for b in sorted(owners))
        raise ConfigError(
            f"{named} is a setting of {choose}, not of --broker {broker}:"
            f" {'remove' if given.source == 'command line' else 'unset'} it, or choose {choose}"
        )


def _route_limits(values: dict[str, Any], route: Route, n: int, limits: PublishLimits) -> PublishLimits:
    """``limits`` with the envelope route ``n`` writes, where it sets its own."""
    if not route.delivery.keys() & {"envelope", "cloudevents_source"}:
        return limits
    own = route_values(values, route, n)
    return replace(limits, cloudevents=cloudevents_from(own, route.broker, names_from(values)))


def publisher_for(broker: str, values: dict[str, Any], limits: PublishLimits) -> Publisher:
    """``broker``'s publisher (relay start, relay replay); with routes, one per route (the
    same settings with the route's destination put in) and one for the default
    destination if it is set, under a :class:`relay.routing.RoutedPublisher`."""
    routes = parse_routes(values.get("route") or (), broker)
    if not routes:
        return create_publisher(broker, values, limits)
    default_value = default_destination(values, broker)
    default = None if default_value is None else create_publisher(broker, values, limits)
    publishers = [
        create_publisher(r.broker, {**values, **r.settings}, _route_limits(values, r, n, limits))
        for n, r in enumerate(routes, start=1)
    ]
    router = Router(routes, has_default=default is not None)
    return RoutedPublisher(router, publishers, default, default_name=shown_destination(default_value or ""))
