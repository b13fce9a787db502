"""`relay console`: the operators' web page (relay.console), on 127.0.0.1:8465 by default.

Its packages (aiohttp, Jinja2) are the ``console`` extra, imported only by this command.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import click

from relay.cli.common import OPS_OPTIONS, AsciiInt, bounded_duration_option, check_text, ops_setup, run, with_options
from relay.dsn import describe_dsn
from relay.durations import parse_duration
from relay.errors import ConfigError

INSTALL_HINT = "pip install 'outbox-relay[console]'"
TOKEN_ENV = "RELAY_CONSOLE_TOKEN"
DEFAULT_PORT = 8465
WINDOW_MIN, WINDOW_MAX = timedelta(minutes=1), timedelta(hours=24)
SAMPLE_MIN, SAMPLE_MAX = timedelta(seconds=1), timedelta(minutes=10)


@click.command("console")
@with_options(OPS_OPTIONS)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option(
    "--port", type=AsciiInt(0, 65535), default=DEFAULT_PORT, show_default=True, help="Port (0: any free port)."
)
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Let the page retry and skip dead messages; every action then needs a --token.",
)
@click.option(
    "--token",
    "tokens",
    multiple=True,
    metavar="[NAME=]SECRET",
    help=f"A token actions must carry (repeatable; also ${TOKEN_ENV}); NAME is who its actions are recorded as.",
)
@click.option("--by", default=None, metavar="WHO", help="Record every action as WHO instead of the token's name.")
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="A Host name the page answers to besides loopback ones and --host (repeatable): the name a proxy"
    " forwards. Other names are refused (DNS rebinding).",
)
@bounded_duration_option("--history", "1h", (WINDOW_MIN, WINDOW_MAX), "How far back the overview's chart goes")
@bounded_duration_option("--sample-interval", "5s", (SAMPLE_MIN, SAMPLE_MAX), "How often the chart is sampled")
def console_cmd(
    host: str,
    port: int,
    allow_actions: bool,
    tokens: tuple[str, ...],
    by: str | None,
    allow_hosts: tuple[str, ...],
    history: str,
    sample_interval: str,
    **cli_values: Any,
) -> None:
    """A web page for operators: status, dead messages by error, blocked aggregates, one
    aggregate or message; with --allow-actions, retry and skip as `relay dead` does."""
    window = parse_duration(history, name="--history", minimum=WINDOW_MIN, maximum=WINDOW_MAX)
    every = parse_duration(sample_interval, name="--sample-interval", minimum=SAMPLE_MIN, maximum=SAMPLE_MAX)
    check_text(by, "--by")
    if by is not None and not by.strip():
        raise ConfigError("invalid --by: empty")
    for name in allow_hosts:
        check_text(name, "--allow-host")
    try:
        from relay.console.app import ConsoleConfig
        from relay.console.auth import parse_token
        from relay.console.hosts import allowed_hosts
        from relay.console.server import ServeOptions, serve
    except ImportError:
        raise ConfigError(f"relay console needs aiohttp and Jinja2, which are not installed: {INSTALL_HINT}") from None
    parsed = [parse_token(t) for t in tokens]
    from_env = os.environ.get(TOKEN_ENV, "")
    if from_env:
        parsed.append(parse_token(from_env, f"${TOKEN_ENV}"))
    if allow_actions and not parsed:
        raise ConfigError(f"--allow-actions needs a token: pass --token NAME=SECRET or set ${TOKEN_ENV}")
    dsn, names = ops_setup(cli_values)
    config = ConsoleConfig(
        names=names,
        where=describe_dsn(dsn),
        allow_actions=allow_actions,
        by=by,
        allowed_hosts=allowed_hosts(host, allow_hosts),
    )
    options = ServeOptions(dsn, host, port, tuple(parsed), window, every)
    run(lambda: serve(config, options))
