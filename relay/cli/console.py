"""`relay console`: the operators' web page (relay.console), on 127.0.0.1:8465 by default.

Its packages (aiohttp, Jinja2) are the ``console`` extra, imported only by this command.
"""

from __future__ import annotations

import os
from typing import Any

import click

from relay.cli.common import OPS_OPTIONS, check_text, ops_target, run, settings_for, settings_of_each, with_options
from relay.dsn import describe_dsn
from relay.errors import ConfigError
from relay.operator_options import CONSOLE_OPTIONS, CONSOLE_TOKEN

INSTALL_HINT = "pip install 'outbox-relay[console]'"
TOKEN_ENV = CONSOLE_TOKEN.env  # RELAY_CONSOLE_TOKEN
CONSOLE_ALL = (*OPS_OPTIONS, *CONSOLE_OPTIONS)


@click.command("console")
@with_options(CONSOLE_ALL)
def console_cmd(**cli_values: Any) -> None:
    """A web page for operators: status, dead messages by error, blocked aggregates, one
    aggregate or message; with --allow-actions, retry and skip as `relay dead` does."""
    # Every outbox a config file lists: the console's own options are the file's top level
    # (and the flags); each outbox's database and table are its entry's.
    listed_outboxes = settings_of_each(CONSOLE_ALL, cli_values)
    each: list[tuple[str | None, dict[str, Any]]]
    each = list(listed_outboxes) if listed_outboxes else [(None, settings_for(CONSOLE_ALL, cli_values))]
    values = each[0][1]
    by: str | None = values["console_by"]
    allow_hosts: tuple[str, ...] = values["console_allow_hosts"]
    check_text(by, "--by")
    if by is not None and not by.strip():
        raise ConfigError("invalid --by: empty")
    for name in allow_hosts:
        check_text(name, "--allow-host")
    try:
        from relay.console.app import ConsoleConfig
        from relay.console.auth import parse_token
        from relay.console.hosts import allowed_hosts
        from relay.console.server import ServeOptions, serve, serve_outboxes
    except ImportError:
        raise ConfigError(f"relay console needs aiohttp and Jinja2, which are not installed: {INSTALL_HINT}") from None
    parsed = [parse_token(t) for t in values["console_tokens"]]
    if values["console_token"]:
        # The variable, when set, is where the one token came from; otherwise the file.
        source = f"${TOKEN_ENV}" if os.environ.get(TOKEN_ENV) else f"{CONSOLE_TOKEN.where} in the config file"
        parsed.append(parse_token(values["console_token"], source))
    allow_actions: bool = values["console_allow_actions"]
    if allow_actions and not parsed:
        raise ConfigError(f"--allow-actions needs a token: pass --token NAME=SECRET or set ${TOKEN_ENV}")
    host: str = values["console_host"]
    outboxes = []
    for outbox, own in each:
        dsn, names = ops_target(own)
        config = ConsoleConfig(
            names=names,
            where=describe_dsn(dsn),
            allow_actions=allow_actions,
            by=by,
            allowed_hosts=allowed_hosts(host, allow_hosts),
            outbox=outbox,
        )
        outboxes.append((config, dsn))
    window, every = values["console_history"], values["console_sample_interval"]
    options = ServeOptions(outboxes[0][1], host, values["console_port"], tuple(parsed), window, every)
    if listed_outboxes:
        run(lambda: serve_outboxes(outboxes, options))
    else:
        run(lambda: serve(outboxes[0][0], options))
