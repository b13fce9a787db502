"""Where the core meets the adapters: the brokers' options and the publisher a run uses.

With the CLI (relay.cli) and the embedded relay (relay.embed), the only modules that import
the adapters (through adapters.registry, which imports a broker's adapter only when that
broker is chosen).
"""

from __future__ import annotations

from typing import Any

from relay.adapters.registry import broker_options, create_publisher
from relay.config import CORE_OPTIONS, LOG_OPTIONS, OPERATE_OPTIONS, START_OPTIONS
from relay.contract import Publisher, PublishLimits
from relay.routes import ROUTES_OPTION, Router, default_destination, parse_routes, shown_destination
from relay.routing import RoutedPublisher

BROKER_OPTIONS = broker_options()
# Every option `relay start` takes (and relay.Relay): one list, one validation.
START_ALL = (*CORE_OPTIONS, *START_OPTIONS, ROUTES_OPTION, *OPERATE_OPTIONS, *LOG_OPTIONS, *BROKER_OPTIONS)


def publisher_for(broker: str, values: dict[str, Any], limits: PublishLimits) -> Publisher:
    """``broker``'s publisher (relay start, relay replay); with routes, one per route (the
    same settings with the route's destination put in) and one for the default
    destination if it is set, under a :class:`relay.routing.RoutedPublisher`."""
    routes = parse_routes(values.get("route") or (), broker)
    if not routes:
        return create_publisher(broker, values, limits)
    default_value = default_destination(values, broker)
    default = None if default_value is None else create_publisher(broker, values, limits)
    publishers = [create_publisher(r.broker, {**values, **r.settings}, limits) for r in routes]
    router = Router(routes, has_default=default is not None)
    return RoutedPublisher(router, publishers, default, default_name=shown_destination(default_value or ""))
