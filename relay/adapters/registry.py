"""Destinations by name: the built-in ones and those installed packages declare, each
found through its :class:`relay.contract.DestinationSpec` (its options, how to build it).

A built-in destination is the package ``relay.adapters.<name>``, whose ``SPEC`` says the
rest; an installed one names its spec in the entry-point group :data:`GROUP`
(``redis-streams = "relay_redis_streams:SPEC"``). Only names are read until a spec is
needed: a destination's module is imported when it is chosen or when every destination's
options are listed (each ``relay`` command does, for ``--help`` and the config file), and
never its SDK, which its publisher imports when it is built. So an installation that never
uses RabbitMQ never imports aio-pika.

An installed destination that cannot be used (its module fails to import, it names no
spec, or a name another destination has) is one warning line, once per process, and its
options are left out; choosing it is one :class:`relay.ConfigError` line saying why.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from relay.contract import DestinationSpec, Publisher, PublishLimits
from relay.errors import ConfigError
from relay.options import Option

log = logging.getLogger("relay.adapters.registry")

# The entry-point group installed packages declare their destinations in.
GROUP = "outbox_relay.destinations"
# Set (to anything but "") to look for no installed destination: the relay then offers the
# built-in ones only (the reference pages are generated so, and the test suite runs so
# except where it tests an installed destination), as PYTEST_DISABLE_PLUGIN_AUTOLOAD does
# for pytest.
DISABLE_INSTALLED = "OUTBOX_RELAY_DISABLE_PLUGIN_AUTOLOAD"
# The destinations outbox-relay ships, in the order --broker lists them.
BUILT_IN = ("sqs", "sns", "rabbitmq", "http", "kafka", "nats", "log")


@dataclass(frozen=True)
class _Installed:
    """One destination an installed package declares: its entry point, and who declares it."""

    entry_point: EntryPoint

    @property
    def origin(self) -> str:
        """``relay-redis-streams 0.1.0 (redis-streams = relay_redis_streams:SPEC)``."""
        dist = self.entry_point.dist
        package = f"{dist.name} {dist.version}" if dist is not None else "an installed package"
        return f"{package} ({self.entry_point.name} = {self.entry_point.value})"


def _installed_enabled() -> bool:
    return not os.environ.get(DISABLE_INSTALLED)


@functools.cache
def _installed(enabled: bool) -> dict[str, _Installed]:
    """The installed destinations by name (none when ``enabled`` is false); each name that
    cannot be used is warned about here, once, and left out."""
    if not enabled:
        return {}
    by_name: dict[str, list[_Installed]] = {}
    for entry_point in entry_points(group=GROUP):
        by_name.setdefault(entry_point.name, []).append(_Installed(entry_point))
    found: dict[str, _Installed] = {}
    for name, declared in sorted(by_name.items()):
        if name in BUILT_IN:
            for one in declared:
                log.warning("destination %s of %s is not used: outbox-relay has it built in", name, one.origin)
        elif len(declared) > 1:
            origins = " and ".join(one.origin for one in declared)
            log.warning("destination %s is declared by %s: neither is used; uninstall one", name, origins)
        else:
            found[name] = declared[0]
    return found


def _names() -> tuple[str, ...]:
    return (*BUILT_IN, *sorted(_installed(_installed_enabled())))


# Every destination's name, the built-in ones first: what --broker accepts.
BROKERS = _names()


def spec_of(name: str) -> DestinationSpec[Any]:
    """The spec of destination ``name``, imported now (a built-in one or an installed
    one); :class:`relay.ConfigError`, one line, for a name no destination has or an
    installed destination that cannot be loaded."""
    loaded = _load(name, _installed_enabled())
    if isinstance(loaded, ConfigError):
        raise loaded
    return loaded


@functools.cache
def _load(name: str, installed_enabled: bool) -> DestinationSpec[Any] | ConfigError:
    # Cached, error included: a destination is imported once, and a broken one warned
    # about once, however often its options are listed.
    if name in BUILT_IN:
        spec = importlib.import_module(f"relay.adapters.{name}").SPEC
        assert isinstance(spec, DestinationSpec) and spec.name == name, name
        return spec
    installed = _installed(installed_enabled).get(name)
    if installed is None:
        return ConfigError(f"no destination is named {name!r}: choose from {', '.join(_names())}")
    try:
        loaded = installed.entry_point.load()
    except Exception as exc:  # whatever its import raises: the one line says what
        return ConfigError(f"destination {name} of {installed.origin} cannot be loaded: {type(exc).__name__}: {exc}")
    if not isinstance(loaded, DestinationSpec):
        return ConfigError(
            f"destination {name} of {installed.origin} is not a relay.DestinationSpec but a {type(loaded).__name__}"
        )
    if loaded.name != name:
        return ConfigError(f"destination {name} of {installed.origin} names itself {loaded.name!r}: make them one")
    return loaded


def specs() -> dict[str, DestinationSpec[Any]]:
    """Every destination's spec that can be loaded, by name, in the order of BROKERS; an
    installed one that cannot is warned about (once) and left out."""
    found: dict[str, DestinationSpec[Any]] = {}
    for name in _names():
        loaded = _load(name, _installed_enabled())
        if isinstance(loaded, ConfigError):
            _warn_once(str(loaded))
        else:
            found[name] = loaded
    return found


@functools.cache
def _warn_once(line: str) -> None:
    log.warning("%s: its options are left out", line)


def options_by_broker() -> dict[str, tuple[Option, ...]]:
    """Each destination's own options, in the order of BROKERS (the reference pages list
    them by destination); an option several take (the AWS region) is in each of them."""
    return {name: spec.options for name, spec in specs().items()}


def broker_options() -> tuple[Option, ...]:
    """Every destination's options, for the CLI and for checking config-file keys; an
    option several destinations take (the AWS region) is declared once and listed once."""
    options: list[Option] = []
    for own in options_by_broker().values():
        options.extend(o for o in own if o not in options)
    return tuple(options)


def create_publisher(broker: str, values: Mapping[str, Any], limits: PublishLimits) -> Publisher:
    """The publisher of ``broker`` from its resolved option ``values`` and the core's ``limits``."""
    return spec_of(broker).create(values, limits)


def max_envelope_fields(broker: str) -> int | None:
    """How many fields the envelope (the relay's and the producer's headers) may hold on
    ``broker``'s wire, None for no limit of that kind (its spec's ``max_envelope_fields``)."""
    return spec_of(broker).max_envelope_fields
