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
from datetime import timedelta
from typing import Any, TypeVar

import click
import psycopg

from relay import logs
from relay.config import (
    CORE_OPTIONS,
    GRANT_OPTIONS,
    LOG_OPTIONS,
    OPERATE_OPTIONS,
    START_OPTIONS,
    names_from,
    require_dsn,
)
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.session import check_schema, connect
from relay.dsn import mask
from relay.durations import format_bound
from relay.errors import ConfigError, DatabaseUnavailable, first_line, shown
from relay.options import Option, check_file_keys, load_file, resolve, unknown_variables
from relay.routes import ROUTES_OPTION
from relay.wiring import BROKER_OPTIONS, VARIABLES, publisher_for

# Every declared setting: the keys a config file may hold, whichever command reads it.
ALL_OPTIONS = (
    *CORE_OPTIONS,
    *START_OPTIONS,
    ROUTES_OPTION,
    *OPERATE_OPTIONS,
    *GRANT_OPTIONS,
    *LOG_OPTIONS,
    *BROKER_OPTIONS,
)
# The operator commands take --dsn, --schema, --table, --config, --log-level and
# --log-format the way `relay migrate` does.
OPS_OPTIONS = (*CORE_OPTIONS, *LOG_OPTIONS)
_DIGITS = re.compile(r"[0-9]{1,19}")  # a count: ASCII digits, as ids (relay.ids)

__all__ = ["ALL_OPTIONS", "BROKER_OPTIONS", "OPS_OPTIONS", "configure_logging", "publisher_for"]

log = logging.getLogger("relay.cli")

T = TypeVar("T")
F = Callable[..., Any]


def with_options(options: Sequence[Option]) -> Callable[[F], F]:
    """Add one click option per declared Option; every default stays None so that
    :func:`relay.options.resolve` can tell "not given" from "given"."""

    def decorate(func: F) -> F:
        for o in reversed(options):
            if o.env_only:
                continue
            bounds = f" [{o.bounds}]" if o.bounds else ""
            help_text = o.help + bounds + f" [env {o.env}]"
            if o.kind == "bool":
                func = click.option(f"{o.flag}/--no-{o.flag[2:]}", o.dest, default=None, help=help_text)(func)
            else:
                func = click.option(
                    o.flag,
                    o.dest,
                    default=None,
                    multiple=o.kind == "list",
                    metavar=_metavar(o),
                    help=help_text,
                )(func)
        return click.option(
            "--config",
            "config_path",
            envvar="RELAY_CONFIG",
            default=None,
            metavar="FILE",
            help="TOML config file. [env RELAY_CONFIG]",
        )(func)

    return decorate


def _metavar(o: Option) -> str:
    if o.kind == "choice":
        return "[" + "|".join(o.choices) + "]"
    return {"duration": "DURATION", "int": "N", "float": "X", "list": "TYPE"}.get(o.kind, "TEXT")


def settings_for(options: Sequence[Option], cli_values: dict[str, Any]) -> dict[str, Any]:
    path = cli_values.pop("config_path", None)
    file = load_file(path)
    if path:
        check_file_keys(file, ALL_OPTIONS, path)
    return resolve(options, cli_values, file)


def configure_logging(values: Mapping[str, Any]) -> None:
    """Logging as a command's ``--log-level`` and ``--log-format`` say; then a warning for
    each RELAY_* variable that no command reads (`relay start` logs them when it starts,
    relay.embed)."""
    logs.configure(values["log_level"], values["log_format"])
    for line in unknown_variables(os.environ, VARIABLES):
        log.warning("%s", line)


def ops_setup(cli_values: dict[str, Any]) -> tuple[str, OutboxNames]:
    """An operator command's values resolved and logging set up: its DSN and outbox."""
    values = settings_for(OPS_OPTIONS, cli_values)
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


def bounded_duration_option(
    flag: str, default: str, bounds: tuple[timedelta, timedelta], help: str
) -> Callable[[F], F]:
    """A duration flag whose help names its range; the command parses it with those bounds
    (:func:`relay.durations.parse_duration`), so a bad value is one line naming the flag."""
    low, high = bounds
    return click.option(
        flag,
        default=default,
        metavar="DURATION",
        show_default=True,
        help=f"{help} ({format_bound(low)}..{format_bound(high)}).",
    )


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
