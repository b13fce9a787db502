"""Brokers by name: their options (for the CLI and config file) and how to build them.

Adapter modules are imported only when their broker is chosen, so an installation that
never uses RabbitMQ never imports aio-pika at run time.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from relay.contract import BROKERS, Publisher, PublishLimits
from relay.errors import ConfigError
from relay.options import Option

# broker name -> module under adapters/ that defines OPTIONS and create(values, limits)
_MODULES = {name: f"relay.adapters.{name}" for name in BROKERS}
# The SDK each broker needs, and the package extra that installs it
# (pip install 'outbox-relay[rabbitmq]'): the base installation has none of them.
_SDKS = {
    "rabbitmq": (("aio_pika", "aiormq", "pamqp"), "rabbitmq"),
    "sqs": (("boto3", "botocore"), "sqs"),
    "sns": (("boto3", "botocore"), "sns"),
    "nats": (("nats",), "nats"),
    "kafka": (("aiokafka", "async_timeout"), "kafka"),
    "http": (("aiohttp", "multidict", "yarl", "aiohappyeyeballs", "aiosignal", "frozenlist", "propcache"), "http"),
}


def options_by_broker() -> dict[str, tuple[Option, ...]]:
    """Each broker's own options, in the order of BROKERS (the reference pages list them
    by broker); an option several brokers take (the AWS region) is in each of them."""
    found: dict[str, tuple[Option, ...]] = {}
    for broker, module_name in _MODULES.items():
        module = _load(module_name)
        if module is not None:
            found[broker] = tuple(getattr(module, "OPTIONS", ()))
    return found


def broker_options() -> tuple[Option, ...]:
    """Every broker's options, for the CLI and for checking config-file keys; an option
    several brokers take (the AWS region) is declared once and listed once."""
    options: list[Option] = []
    for own in options_by_broker().values():
        options.extend(o for o in own if o not in options)
    return tuple(options)


def create_publisher(broker: str, values: Mapping[str, Any], limits: PublishLimits) -> Publisher:
    """The publisher of ``broker`` from its resolved option ``values`` and the core's ``limits``."""
    module = _load(_MODULES[broker])
    if module is None:
        raise ModuleNotFoundError(f"broker {broker!r} is not available in this installation")
    try:
        publisher: Publisher = module.create(values, limits)
    except ModuleNotFoundError as exc:
        sdks, extra = _SDKS.get(broker, ((), ""))
        missing = (exc.name or "").partition(".")[0]
        if missing not in sdks:
            raise
        raise ConfigError(
            f"--broker {broker} needs {missing}, which is not installed: pip install 'outbox-relay[{extra}]'"
        ) from None
    return publisher


def max_envelope_fields(broker: str) -> int | None:
    """How many fields the envelope (the relay's and the producer's headers) may hold on
    ``broker``'s wire, None for no limit of that kind: an adapter with one declares it as
    ``MAX_ENVELOPE_FIELDS`` (SQS and SNS take 10 message attributes)."""
    module = _load(_MODULES[broker])
    limit = getattr(module, "MAX_ENVELOPE_FIELDS", None)
    return None if limit is None else int(limit)


def _load(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:  # the adapter module itself is not there yet
            return None
        raise
