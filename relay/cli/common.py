"""What the ``relay`` commands share: the option decorators, how flags, variables and the
config file become one dict of values, and how a command's database work runs.

Every command module imports this one and nothing imports a command module but
:mod:`relay.cli.main`, which registers them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

import click
import psycopg

from relay import logs
from relay.config import (
    CORE_OPTIONS,
    LOG_OPTIONS,
    names_from,
    require_dsn,
)
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.session import check_schema, connect
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, first_line, shown
from relay.options import Option, SizeOption, check_file_keys, load_file, resolve, unknown_variables
from relay.outboxes import chosen_file, listed
from relay.sizes import format_size
from relay.wiring import ALL_OPTIONS, BROKER_OPTIONS, VARIABLES, publisher_for

# What the operator commands warn about when set but read by none (configure_logging).
KNOWN_VARIABLES = VARIABLES
# The operator commands take --dsn, --schema, --table, --config, --log-level and
# --log-format the way `relay migrate` does.
OPS_OPTIONS = (*CORE_OPTIONS, *LOG_OPTIONS)
_DIGITS = re.compile(r"[0-9]{1,19}")  # a count: ASCII digits, as ids (relay.ids)

__all__ = ["ALL_OPTIONS", "BROKER_OPTIONS", "KNOWN_VARIABLES", "OPS_OPTIONS", "configure_logging", "publisher_for"]

log = logging.getLogger("relay.cli")

T = TypeVar("T")
F = Callable[..., Any]


class DeclaredOption(click.Option):
    """A click option made by :func:`with_options` from a declared :class:`Option`, which it
    keeps as ``declared``: the reference (scripts/docs_reference.py) and the tests read a
    command's options from it, not from click's names."""

    def __init__(self, *args: Any, declared: Option, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.declared = declared


def with_options(options: Sequence[Option]) -> Callable[[F], F]:
    """Add one click option per declared Option, and ``--config``; every default stays None
    so that :func:`relay.options.resolve` can tell "not given" from "given"."""
    params = [o.param for o in options if not o.env_only]
    twice = sorted({p for p in params if params.count(p) > 1})
    if twice:
        # click would keep one of them silently.
        raise ValueError(f"with_options: two options of one command take the flag of {', '.join(twice)}")

    def decorate(func: F) -> F:
        for o in reversed(options):
            if not o.env_only:
                func = _click_option(o)(func)
        return click.option(
            "--config",
            "config_path",
            envvar="RELAY_CONFIG",
            default=None,
            metavar="FILE",
            help="TOML config file. [env RELAY_CONFIG]",
        )(func)

    return decorate


def _click_option(o: Option) -> Callable[[F], F]:
    help_text = o.help + "".join(f" [{part}]" for part in _help_notes(o))
    if o.kind == "bool" and o.cli_only and o.default is False:
        # A command-line-only switch that is off unless given needs no --no- form: nothing
        # else can turn it on.
        return click.option(o.flag, o.param, is_flag=True, default=None, help=help_text, cls=DeclaredOption, declared=o)
    if o.kind == "bool":
        # --no-x, so that a flag can turn off what the variable or the file turned on.
        flags = f"{o.flag}/--no-{o.flag[2:]}"
        return click.option(flags, o.param, default=None, help=help_text, cls=DeclaredOption, declared=o)
    return click.option(
        o.flag,
        o.param,
        default=None,
        multiple=o.kind == "list",
        type=_click_type(o),
        metavar=o.metavar or _metavar(o),
        help=help_text,
        cls=DeclaredOption,
        declared=o,
    )


def _help_notes(o: Option) -> list[str]:
    """What --help adds to an option's help: its default, its bounds, its variable."""
    notes = []
    default = _default_text(o)
    if default is not None:
        notes.append(f"default: {default}")
    if o.bounds:
        notes.append(o.bounds)
    if o.reads_env:
        notes.append(f"env {o.env}")
    return notes


def _default_text(o: Option) -> str | None:
    """An option's default as --help shows it; none for a secret, an empty one, or a switch
    that is off unless given."""
    value = o.default
    if o.secret or value is None or value == () or (o.kind == "bool" and o.cli_only and value is False):
        return None
    if o.kind == "bool":
        return o.flag if value else f"--no-{o.flag[2:]}"
    if isinstance(o, SizeOption):
        return format_size(int(value))
    if o.kind == "list":
        return ", ".join(str(v) for v in value)
    return str(value)


def _click_type(o: Option) -> click.ParamType[Any] | None:
    """The type click checks the flag's value with, where the declaration asks for click's
    words (``click_checked``); otherwise none, and :meth:`Option.parse` says what is wrong."""
    if not o.click_checked:
        return None
    if o.kind == "int" and o.minimum is not None and o.maximum is not None:
        return AsciiInt(int(o.minimum), int(o.maximum))
    if o.kind == "choice":
        return click.Choice(o.choices)
    raise ValueError(f"option {o.dest}: click_checked needs an int with both bounds, or a choice")


def _metavar(o: Option) -> str:
    if o.kind == "choice":
        return "[" + "|".join(o.choices) + "]"
    return {"duration": "DURATION", "int": "N", "float": "X", "list": "TYPE"}.get(o.kind, "TEXT")


def settings_for(options: Sequence[Option], cli_values: dict[str, Any]) -> dict[str, Any]:
    """``options``' values, each from its flag (in ``cli_values``, a command's keyword
    arguments), variable, the ``--config`` file or its default, keyed by dest."""
    path = cli_values.pop("config_path", None)
    cli = _flag_values(options, cli_values)
    file = chosen_file(load_file(path), chosen_outbox(cli), path, command=command_name())
    if path:
        check_file_keys(file, ALL_OPTIONS, path)
    return resolve(options, cli, file)


def settings_of_each(options: Sequence[Option], cli_values: dict[str, Any]) -> list[tuple[str, dict[str, Any]]] | None:
    """For a command that can act on every outbox a config file lists (relay status, relay
    console): each outbox's name and ``options``' values as that outbox reads them (flags
    and variables over its entry over the file's top level), in the file's order; None when
    the file lists none or ``--outbox`` picks one (then :func:`settings_for` applies)."""
    path = cli_values.get("config_path")
    if chosen_outbox(cli_values) is not None:
        return None
    entries = listed(load_file(path), None, path)
    if not entries:
        return None
    cli_values.pop("config_path", None)
    cli = _flag_values(options, cli_values)
    return [(e.name, resolve(options, cli, e.file)) for e in entries]


def _flag_values(options: Sequence[Option], cli_values: Mapping[str, Any]) -> dict[str, Any]:
    # click names a flag's value after the flag (`port` for `relay console --port`); the
    # engine knows the option by its dest (console_port).
    return {o.dest: cli_values[o.param] for o in options if o.param in cli_values}


def chosen_outbox(cli: Mapping[str, Any]) -> str | None:
    """The outbox of a config file's list that ``--outbox`` or RELAY_OUTBOX names."""
    return cli.get("outbox") or os.environ.get("RELAY_OUTBOX") or None


def command_name() -> str:
    """The running command as typed (`relay dead list`), for messages."""
    ctx = click.get_current_context(silent=True)
    return f"`{ctx.command_path}`" if ctx is not None else "this command"


def configure_logging(values: Mapping[str, Any]) -> None:
    """Logging as a command's ``--log-level`` and ``--log-format`` say; then a warning for
    each RELAY_* variable that no command reads (`relay start` logs them when it starts,
    relay.embed)."""
    logs.configure(values["log_level"], values["log_format"])
    for line in unknown_variables(os.environ, KNOWN_VARIABLES):
        log.warning("%s", line)


def ops_target(values: Mapping[str, Any]) -> tuple[str, OutboxNames]:
    """An operator command's logging set up from its resolved values (after the command
    checked its own, so that bad input is refused first): its DSN and outbox."""
    configure_logging(values)
    return require_dsn(values), names_from(values)


class AsciiInt(click.types.IntParamType):
    """A whole number in ASCII digits within ``low``..``high``: click.INT, like int(), also
    takes "1_0" (10) and "\u0661" (an Arabic-Indic 1)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
            number = int(value.strip())
        else:
            self.fail(f"{shown(value)} is not a whole number (ASCII digits)", param, ctx)
        if not self.low <= number <= self.high:
            self.fail(f"{number} is not in the range {self.low}..{self.high:,}", param, ctx)
        return number


def check_text(value: str | None, what: str) -> None:
    """Refuse text the database could not take. Bytes that are not UTF-8 in an argument
    reach Python as lone surrogates, which no client encoding can send."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"invalid {what}: not UTF-8 text (character {exc.start + 1} of {len(value):,})") from None


# ---- running


async def with_conn(dsn: str, names: OutboxNames, body: Callable[[Conn], Awaitable[T]]) -> T:
    """``body`` on a new connection to an outbox whose schema is checked first."""
    conn = await connect(dsn)
    async with conn:
        await check_schema(conn, names)
        return await body(conn)


def masked_first_line(exc: BaseException) -> str:
    return mask(first_line(exc))


def run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a command's coroutine; database errors become one masked line (exit code 2)."""
    try:
        return asyncio.run(make())
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"database error: {masked_first_line(exc)}") from None
    except psycopg.Error as exc:
        raise ConfigError(f"the database refused the request: {masked_first_line(exc)}") from None
