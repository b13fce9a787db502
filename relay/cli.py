"""The ``relay`` command line. Options come from flags, ``RELAY_*`` variables and the
TOML file (``--config``), in that order; see :mod:`relay.config`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import click
import psycopg

from adapters.registry import broker_options, create_publisher
from relay import logs
from relay.config import (
    CORE_OPTIONS,
    LOG_OPTIONS,
    OPERATE_OPTIONS,
    ORDERING_OPTIONS,
    START_OPTIONS,
    RelaySettings,
    names_from,
    ordering_from,
    require_dsn,
)
from relay.db import connect
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, first_line
from relay.migrate import migrate as apply_migrations
from relay.migrate import pg_message
from relay.options import Option, check_file_keys, load_file, resolve
from relay.shared_settings import SHARED_OPTIONS, SettingsUpdate, given_settings, render_change, update_settings

BROKER_OPTIONS = broker_options()
ALL_OPTIONS = (*CORE_OPTIONS, *START_OPTIONS, *OPERATE_OPTIONS, *LOG_OPTIONS, *BROKER_OPTIONS)
EXIT_USAGE = 2
EXIT_FAILURE = 1

F = Callable[..., Any]


def with_options(options: Sequence[Option]) -> Callable[[F], F]:
    """Add one click option per declared Option; every default stays None so that
    :func:`relay.options.resolve` can tell "not given" from "given"."""

    def decorate(func: F) -> F:
        for o in reversed(options):
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


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="outbox-relay", prog_name="relay")
def cli() -> None:
    """outbox-relay: delivers transactional-outbox rows from PostgreSQL to a broker."""


# For migrate, the shared settings' options default to "not given": only a map (or a
# notify) someone asked for replaces the stored one.
MIGRATE_OPTIONS = (*CORE_OPTIONS, *(replace(o, default=None) for o in SHARED_OPTIONS), *LOG_OPTIONS)


@cli.command("migrate")
@with_options(MIGRATE_OPTIONS)
def migrate_cmd(**cli_values: Any) -> None:
    """Create or upgrade the outbox table (idempotent; safe to run concurrently).

    With --ordering-default/--ordered/--unordered (or an [ordering] table in --config), also
    store that ordering map, so rows are routed by it from then on; with --notify/--no-notify,
    store whether producers' inserts wake the relays. Both are shared by every relay of the
    outbox (`relay settings show`); without these options the stored settings stay as they are.
    """
    values = settings_for(MIGRATE_OPTIONS, cli_values)
    logs.configure(values["log_level"], values["log_format"])
    dsn, names = require_dsn(values), names_from(values)
    given = any(values[o.dest] not in (None, ()) for o in ORDERING_OPTIONS)
    ordering = ordering_from(values) if given else None
    if ordering is not None:
        update: SettingsUpdate | None = SettingsUpdate.whole_map(ordering, notify=values["notify"])
    else:
        update = SettingsUpdate(notify=values["notify"]) if values["notify"] is not None else None

    async def run() -> None:
        conn = await connect(dsn)
        async with conn:
            result = await apply_migrations(conn, names)
            try:
                change = await update_settings(conn, names, update) if update is not None else None
            except psycopg.Error as exc:
                why = pg_message(exc)
                raise ConfigError(f"cannot store the shared settings of {names.qualified}: {why}") from None
        if result.applied:
            click.echo(f"{names.qualified}: applied {', '.join(result.applied)}")
        else:
            click.echo(f"{names.qualified}: up to date ({len(result.already)} migrations applied earlier)")
        if ordering is not None:
            click.echo(f"{names.qualified}: ordering map stored: {ordering.describe()}")
        if change is not None:
            click.echo(render_change(change, names))

    asyncio.run(run())


START_ALL = (*CORE_OPTIONS, *START_OPTIONS, *OPERATE_OPTIONS, *LOG_OPTIONS, *BROKER_OPTIONS)


@cli.command("start")
@with_options(START_ALL)
def start_cmd(**cli_values: Any) -> None:
    """Deliver outbox rows to the broker until SIGINT or SIGTERM."""
    from relay.runner import Operations, run_relay

    config_path = cli_values.get("config_path")
    values = settings_for(START_ALL, cli_values)
    logs.configure(values["log_level"], values["log_format"])
    settings = RelaySettings.from_values(values)
    # The shared settings this process was told explicitly: compared with the stored ones
    # at start, never written (`relay settings set` changes those).
    given = given_settings(values, cli_values, load_file(config_path), os.environ)
    publisher = create_publisher(settings.broker, values, settings.publish_limits)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = {"count": 0}

        def on_signal() -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                # A second signal means "now": leases return every claimed row.
                os._exit(130)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await run_relay(settings, publisher, stop, operate=Operations.from_values(values), given=given)

    asyncio.run(run())


# The operator commands (status, explain, dead, prune, release) and `relay settings` live
# in their own modules, which import this one: registered here, after the commands they
# sit beside.
from relay.cli_ops import register as _register_ops  # noqa: E402
from relay.cli_settings import register as _register_settings  # noqa: E402

_register_ops(cli)
_register_settings(cli)


def _terminate_before_start(signum: int, frame: object) -> None:
    # SIGTERM while still starting up (imports, connecting): nothing is claimed yet, so a
    # clean exit is the whole drain. `relay start` installs its draining handler later.
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point: one clear line and exit code 2 for bad input, never a traceback."""
    signal.signal(signal.SIGTERM, _terminate_before_start)
    args = list(argv) if argv is not None else sys.argv[1:]
    try:
        code = cli.main(args=args, prog_name="relay", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except (click.Abort, KeyboardInterrupt):
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"relay: {_joined(exc.format_message())}", err=True)
        sys.exit(EXIT_USAGE)
    except (ConfigError, DatabaseUnavailable) as exc:
        click.echo(f"relay: {_joined(str(exc))}", err=True)
        sys.exit(EXIT_USAGE)
    except Exception as exc:
        # A bug or a case nobody foresaw: still one line, and the traceback on request.
        debug = _debugging(args)
        if debug:
            click.echo(mask("".join(traceback.format_exception(exc))).rstrip(), err=True)
        detail = _first_line(str(exc))
        click.echo(
            f"relay: unexpected error: {type(exc).__name__}" + (f": {detail}" if detail else "")
            + ("" if debug else " (rerun with --log-level debug for the traceback)"),
            err=True,
        )  # fmt: skip
        sys.exit(EXIT_FAILURE)
    sys.exit(code if isinstance(code, int) else 0)


# An unexpected error's line quotes at most this much of its message: a terminal line or two.
ERROR_LINE_MAX = 300


def _joined(text: str) -> str:
    """Our own error message, masked, its lines (if it ever has several) joined into one."""
    return mask(" ".join(line.strip() for line in text.splitlines() if line.strip()))


def _first_line(text: str) -> str:
    """The first non-empty line of someone else's message, masked, cut to :data:`ERROR_LINE_MAX`."""
    line = mask(first_line(text))
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 3] + "..."


def _debugging(args: Sequence[str]) -> bool:
    """Whether the failed command ran at debug level: configured so (from a flag, the
    environment or the file) or, if it failed before logging was set up, asked for."""
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        return True
    if os.environ.get("RELAY_LOG_LEVEL", "").strip().lower() == "debug":
        return True
    pairs = zip(args, [*args[1:], ""], strict=True)
    return any(a == "--log-level=debug" or (a == "--log-level" and b == "debug") for a, b in pairs)


if __name__ == "__main__":
    main()
