"""The composition root: where settings enter, and the parts of a run are built from them.

Every entry point comes through here: `relay start` and :class:`relay.Relay`
(:func:`compose_start`), `relay replay` and :class:`relay.Replay`
(:func:`compose_replay`). Each takes what its caller was given (flags, or Python
keyword arguments), the ``RELAY_*`` variables and a config file, resolves them once with
the option engine (:mod:`relay.options`; flag over variable over file over default), and
returns frozen, typed parts: the core's settings, the destination's publisher (whose own
settings its adapter checked and typed), tracing, the operations run beside the workers,
logging. The dictionary of resolved values never leaves this module and the
``from_values`` constructors it calls; nothing below reads a setting by its name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from relay.backoff import Backoff
from relay.config import (
    CORE_OPTIONS,
    LOG_OPTIONS,
    OTEL_OPTION,
    START_OPTIONS,
    RelaySettings,
    claim_checks_from,
    cloudevents_from,
    names_from,
    require_broker,
    require_dsn,
    session_limits,
)
from relay.contract import Publisher, PublishLimits
from relay.db.names import OutboxNames
from relay.db.session import SessionLimits, check_schema, configure_session, connect, open_pool
from relay.errors import ConfigError, shown
from relay.options import Option, check_file_keys, did_you_mean, load_file, resolve, unknown_variables
from relay.outboxes import OUTBOXES_KEY, WHERE, chosen_file, listed, refuse_shared_where
from relay.replay import ReplayLimits
from relay.routes import DEFAULT_DESTINATION, ROUTES_OPTION, destination_namer
from relay.runner import Operations
from relay.shared_settings import Given, given_settings
from relay.tracing import Tracing, tracing_for
from relay.wiring import ALL_OPTIONS, BROKER_OPTIONS, START_ALL, VARIABLES, publisher_for, refuse_other_destinations


@dataclass(frozen=True)
class LogSettings:
    """``--log-level`` and ``--log-format`` (applied by the commands; an embedding
    application configures its own logging)."""

    level: str = "info"
    format: str = "text"


@dataclass(frozen=True)
class StartParts:
    """Everything a relay run is built of, checked: `relay start` and relay.Relay."""

    settings: RelaySettings
    operations: Operations
    log: LogSettings
    publisher: Publisher
    tracing: Tracing
    # The shared settings this run's configuration named explicitly (warned about where
    # the stored ones disagree).
    given: tuple[Given, ...]


def compose_start(
    given: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    config: str | None = None,
    publisher: Publisher | None = None,
) -> StartParts:
    """The parts of a relay run from ``given`` (option values by their ``dest``: parsed
    flags, or Python values), ``environ`` and the config file ``config``.
    :class:`relay.ConfigError`, one line naming the option, for anything wrong, before
    anything connects. ``publisher``: one of the caller's own (a test's, a destination
    not installed), used instead of the one ``--broker`` would build."""
    entered = _enter(START_ALL, given, environ, config, "relay setting", "`relay start`'s options")
    settings = _settings(entered, publisher)
    # Made here, so that a bad route or broker setting is refused before anything runs.
    built = publisher or publisher_for(settings.broker, entered.values, settings.publish_limits)
    return _start_parts(entered, settings, built, own=publisher is not None)


def _settings(entered: _Entered, publisher: Publisher | None) -> RelaySettings:
    checked = RelaySettings.from_values(entered.values, broker=None if publisher is None else publisher.name)
    if publisher is None:
        refuse_other_destinations(checked.broker, entered.given, entered.environ)
    # Logged when the relay starts, beside the other warnings of its settings.
    misspelt = tuple(unknown_variables(entered.environ, VARIABLES))
    return replace(checked, warnings=misspelt + checked.warnings) if misspelt else checked


def _start_parts(entered: _Entered, settings: RelaySettings, publisher: Publisher, *, own: bool) -> StartParts:
    """``own``: the publisher is the caller's (relay.testing's), not one ``--broker`` built."""
    v = entered.values
    return StartParts(
        settings=settings,
        operations=Operations.from_values(v),
        log=LogSettings(level=v["log_level"], format=v["log_format"]),
        publisher=publisher,
        tracing=tracing_for(v) if own else _tracing(v, settings.broker),
        given=given_settings(v, entered.given, entered.file, entered.environ),
    )


@dataclass(frozen=True)
class OutboxParts:
    """One outbox of several, checked: its name and its run's parts."""

    name: str
    parts: StartParts


@dataclass(frozen=True)
class FleetParts:
    """A relay process serving several outboxes (relay.fleet): each outbox's parts, and
    what the process holds once for all of them."""

    outboxes: tuple[OutboxParts, ...]
    # The distinct publishers, each started once and shared by the outboxes whose
    # destination settings are the same.
    publishers: tuple[Publisher, ...]
    operations: Operations  # the metrics endpoint's settings (the process's own)
    log: LogSettings
    tracing: Tracing


def compose_outboxes(
    given: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    config: str | None = None,
    outboxes: Sequence[Mapping[str, Any]] | None = None,
    publisher: Publisher | None = None,
) -> FleetParts | None:
    """The parts of a run of several outboxes, as the config file's ``[[outboxes]]`` or
    ``outboxes`` (relay.Relay's) list them (relay.outboxes); None when neither lists any.
    Every outbox is checked before anything connects, each error naming its outbox."""
    file = load_file(config)
    env = dict(environ or {})
    known = {o.dest: o for o in START_ALL}
    top_given = _given_values(given, known, "relay setting", "`relay start`'s options")
    if _chosen(top_given, env) is not None and not outboxes:
        return None  # one outbox of the file's list, run as a relay of one (compose_start)
    entries = listed(file, outboxes, config)
    if not entries:
        return None
    if outboxes is None:
        # A flag or variable would move every outbox the file lists to one place. Given to
        # relay.Relay beside its list, it is a default under each entry's own.
        refuse_shared_where(top_given, env, {d: known[d].env for d in WHERE})
    if config:
        check_file_keys({k: v for k, v in file.items() if k != OUTBOXES_KEY}, ALL_OPTIONS, config)
    checked: list[tuple[str, _Entered, RelaySettings]] = []
    places: dict[tuple[str, str, str], str] = {}
    for entry in entries:
        own = _given_values(entry.given, known, f"setting of outbox {entry.name}", "`relay start`'s options")
        raw = {**top_given, **own}
        try:
            if entry.file is not file:
                check_file_keys(entry.file, ALL_OPTIONS, entry.where)
            entered = _Entered(resolve(START_ALL, raw, entry.file, env), raw, dict(entry.file), env)
            settings = _settings(entered, publisher)
        except ConfigError as exc:
            raise ConfigError(f"outbox {entry.name}: {exc}") from None
        names = settings.names
        place = (settings.dsn, names.schema, names.table)
        if place in places:
            raise ConfigError(f"outboxes {places[place]} and {entry.name} are the same table {names.qualified}")
        places[place] = entry.name
        checked.append((entry.name, entered, settings))
    publishers = _shared_publishers(checked, publisher)
    each = tuple(
        OutboxParts(name, _start_parts(entered, settings, publishers[i], own=publisher is not None))
        for i, (name, entered, settings) in enumerate(checked)
    )
    first = each[0].parts
    return FleetParts(
        outboxes=each,
        publishers=tuple({id(p): p for p in publishers}.values()),  # by identity: some are unhashable
        operations=first.operations,
        log=first.log,
        tracing=first.tracing,
    )


def _shared_publishers(
    checked: Sequence[tuple[str, _Entered, RelaySettings]], own: Publisher | None
) -> list[Publisher]:
    """One publisher per outbox, the same object for outboxes whose destination settings
    agree (one broker connection for them all), told of all their workers."""
    if own is not None:
        return [own] * len(checked)
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for i, (_, entered, settings) in enumerate(checked):
        by_key.setdefault(_destination_key(settings, entered.values), []).append(i)
    publishers: dict[int, Publisher] = {}
    for members in by_key.values():
        name, entered, settings = checked[members[0]]
        limits = replace(settings.publish_limits, workers=sum(checked[i][2].workers for i in members))
        try:
            publisher = publisher_for(settings.broker, entered.values, limits)
        except ConfigError as exc:
            raise ConfigError(f"outbox {name}: {exc}") from None
        for i in members:
            publishers[i] = publisher
    return [publishers[i] for i in range(len(checked))]


def _destination_key(settings: RelaySettings, values: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two outboxes' publishers the same: the broker, its options and routes,
    and the limits a publisher is built with (but the workers, which add up), the
    CloudEvents envelope among them (its source names the outbox by default)."""
    broker = tuple((o.dest, repr(values.get(o.dest))) for o in BROKER_OPTIONS)
    return (
        settings.broker,
        broker,
        repr(values.get("route")),
        settings.worker.publish_timeout,
        settings.worker.batch_size,
        settings.cloudevents,
    )


# The settings of `relay start` that a replay takes too (the same names, environment
# variables and config-file keys), with what each means there.
_REPLAY_MEANINGS = {
    "broker": None,
    "workers": "Batches published at once (of different aggregates).",
    "batch_size": "Messages one publish sends at most.",
    "batch_bytes": "Payload bytes one publish sends at most (512KiB, 4MiB, 10MB or bytes); a larger one goes alone.",
    "publish_timeout": None,
    "max_attempts": "Tries a message gets after retryable failures before it is reported as not replayed.",
    "backoff_base": None,
    "backoff_cap": None,
    "statement_timeout": "PostgreSQL cancels a statement of the replay's session that runs longer (0s: off);"
    " the plan, taken once at the start, has no limit of its own.",
    "idle_in_transaction_timeout": None,
    "envelope": None,
    "cloudevents_source": None,
    "claim_check_bucket": None,
    "claim_check_threshold": None,
    "claim_check_prefix": None,
    "claim_check_endpoint_url": None,
    "claim_check_region": None,
}
REPLAY_OPTIONS: tuple[Option, ...] = (
    *CORE_OPTIONS,
    *(replace(o, help=_REPLAY_MEANINGS[o.dest] or o.help) for o in START_OPTIONS if o.dest in _REPLAY_MEANINGS),
    ROUTES_OPTION,
    OTEL_OPTION,
    *LOG_OPTIONS,
    *BROKER_OPTIONS,
)


@dataclass(frozen=True)
class ReplayParts:
    """Everything a replay is built of, checked: `relay replay` and relay.Replay."""

    dsn: str
    names: OutboxNames
    session: SessionLimits
    limits: ReplayLimits
    publisher: Publisher
    tracing: Tracing
    log: LogSettings
    # Where the messages go, in words (the broker and its destinations or routes).
    where: str
    # Lines to log once as warnings (RELAY_* variables no setting reads).
    warnings: tuple[str, ...] = ()


def compose_replay(
    given: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    config: str | None = None,
    to: str | None = None,
    rate: float | None = None,
) -> ReplayParts:
    """The parts of a replay from ``given`` (as :func:`compose_start`), sending everything
    to the destination ``to`` when given (routes ignored), at most ``rate`` messages a
    second."""
    entered = _enter(REPLAY_OPTIONS, given, environ, config, "replay setting", "`relay replay`'s options")
    v = entered.values
    dsn, names = require_dsn(v), names_from(v)
    broker = require_broker(v)
    refuse_other_destinations(broker, entered.given, entered.environ)
    if to is not None:
        v = _only_to(v, broker, to)
    limits = ReplayLimits(
        workers=v["workers"],
        batch_size=v["batch_size"],
        batch_bytes=v["batch_bytes"],
        publish_timeout=v["publish_timeout"],
        max_attempts=v["max_attempts"],
        backoff=Backoff(base=v["backoff_base"], cap=v["backoff_cap"]),
        rate=rate,
        claim_check=claim_checks_from(v, broker),
    )
    publish = PublishLimits(
        limits.publish_timeout,
        workers=limits.workers,
        batch_size=limits.batch_size,
        # A replay's events are the same CloudEvents (the same ids) as their first delivery.
        cloudevents=cloudevents_from(v, broker, names),
    )
    return ReplayParts(
        dsn=dsn,
        names=names,
        session=session_limits(v),
        limits=limits,
        # Built before anything is read, so that broker options no run could use fail first.
        publisher=publisher_for(broker, v, publish),
        tracing=_tracing(v, broker),
        log=LogSettings(level=v["log_level"], format=v["log_format"]),
        where=_where(v, broker),
        warnings=tuple(unknown_variables(entered.environ, VARIABLES)),
    )


async def checked_session(
    dsn: str, names: OutboxNames, limits: SessionLimits, *, application_name: str
) -> psycopg.AsyncConnection[Any]:
    """A session of its own on the outbox's database, set up as the relay's own (its
    limits, its text), the outbox's schema checked: what a replay runs in."""
    conn = await connect(dsn, application_name=application_name)
    try:
        await configure_session(conn, limits)
        await check_schema(conn, names)
    except BaseException:
        await conn.close()
        raise
    return conn


async def checked_pool(dsn: str, names: OutboxNames, size: int) -> AsyncConnectionPool[Any]:
    """A pool on the outbox's database once its schema is checked on a first connection:
    what the console reads and acts through."""
    probe = await connect(dsn)
    async with probe:
        await check_schema(probe, names)
    return await open_pool(dsn, size)


@dataclass(frozen=True)
class _Entered:
    values: dict[str, Any]  # every option's value, resolved and parsed
    given: dict[str, Any]  # what the caller gave, as the parser takes it
    file: dict[str, Any]
    environ: dict[str, str]


def _enter(
    options: Sequence[Option],
    given: Mapping[str, Any],
    environ: Mapping[str, str] | None,
    config: str | None,
    what: str,
    whose: str,
) -> _Entered:
    raw = _given_values(given, {o.dest: o for o in options}, what, whose)
    env = dict(environ or {})
    file = chosen_file(load_file(config), _chosen(raw, env), config, command=whose.removesuffix("'s options"))
    if config:
        # Against every declared setting: one file serves relay start, relay replay and the
        # operator commands alike (a [console] table is not a mistake here).
        check_file_keys(file, ALL_OPTIONS, config)
    return _Entered(resolve(options, raw, file, env), raw, file, env)


def _chosen(raw: Mapping[str, Any], env: Mapping[str, str]) -> str | None:
    """The outbox of a config file's list that ``--outbox`` (or RELAY_OUTBOX) names."""
    return raw.get("outbox") or env.get("RELAY_OUTBOX") or None


def _given_values(given: Mapping[str, Any], known: Mapping[str, Option], what: str, whose: str) -> dict[str, Any]:
    """``given`` (Python values by option name) as the parser takes them; an unknown name
    refused with the nearest known one."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown {what} {shown(unknown[0])}{did_you_mean(unknown[0], known)}:"
            f" the settings are {whose}, named without the dashes"
        )
    return {name: _raw(value) for name, value in given.items() if value is not None and value != ()}


def _raw(value: Any) -> Any:
    """A Python value as the option parser takes it (what a command line or TOML gives)."""
    if isinstance(value, timedelta):
        return f"{value.total_seconds()}s"
    if isinstance(value, list):
        return tuple(value)
    return value


def _tracing(values: Mapping[str, Any], broker: str) -> Tracing:
    # OpenTelemetry is imported here or never (relay.tracing's no-op without --otel).
    from relay.adapters.registry import max_envelope_fields

    return tracing_for(values, max_envelope_fields=max_envelope_fields(broker))


def _only_to(values: dict[str, Any], broker: str, destination: str) -> dict[str, Any]:
    """``values`` with every message going to ``destination``: the broker's default
    destination set to it and the routes dropped."""
    key = DEFAULT_DESTINATION.get(broker)
    if key is None:
        raise ConfigError(f"--to: --broker {broker} has no destinations to choose from")
    if key != "exchange" and not destination.strip():
        raise ConfigError("invalid --to: must not be empty")
    return {**values, key: destination if key == "exchange" else destination.strip(), "route": ()}


def _where(values: Mapping[str, Any], broker: str) -> str:
    """Where the messages go, in words, for a replay's first line."""
    namer = destination_namer(values)
    if namer is None:  # pragma: no cover - a broker is always set here
        return "?"
    routes = values.get("route") or ()
    default = namer("\x00 no route takes this")  # an event type no route matches
    if not routes:
        return f"{broker} {default}"
    return f"{broker} routes ({len(routes)}) and {default} for the rest"
