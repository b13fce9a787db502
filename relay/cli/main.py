"""The ``relay`` command line. Options come from flags, ``RELAY_*`` variables and the
TOML file (``--config``), in that order; see :mod:`relay.options`.

This module holds the ``relay`` group and the console entry point :func:`main`; each
command family lives in a module of its own (:mod:`relay.cli.migrate`,
:mod:`~relay.cli.start`, :mod:`~relay.cli.ops`, :mod:`~relay.cli.dead`,
:mod:`~relay.cli.settings`, :mod:`~relay.cli.console`) and is registered here with ``add_command``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence

import click

from relay.cli.console import console_cmd
from relay.cli.dead import dead_group
from relay.cli.grants import grants_cmd
from relay.cli.migrate import migrate_cmd
from relay.cli.ops import explain_cmd, prune_cmd, release_cmd, status_cmd
from relay.cli.replay import replay_cmd
from relay.cli.settings import settings_group
from relay.cli.start import start_cmd
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, first_line

EXIT_USAGE = 2
EXIT_FAILURE = 1


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="outbox-relay", prog_name="relay")
def cli() -> None:
    """outbox-relay: delivers transactional-outbox rows from PostgreSQL to a broker."""


for command in (
    migrate_cmd,
    grants_cmd,
    start_cmd,
    replay_cmd,
    status_cmd,
    explain_cmd,
    dead_group,
    prune_cmd,
    release_cmd,
    settings_group,
    console_cmd,
):
    cli.add_command(command)


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
