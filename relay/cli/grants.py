"""`relay grants`: the SQL that grants producer and relay roles their privileges, for a DBA
to read and run (what `relay migrate --grant-producer/--grant-relay` runs itself)."""

from __future__ import annotations

from typing import Any

import click

from relay.cli.common import configure_logging, run, settings_for, with_conn, with_options
from relay.config import CORE_OPTIONS, GRANT_OPTIONS, LOG_OPTIONS, names_from, require_dsn
from relay.db import grants
from relay.db.rows import Conn
from relay.errors import ConfigError

GRANTS_OPTIONS = (*CORE_OPTIONS, *GRANT_OPTIONS, *LOG_OPTIONS)


@click.command("grants")
@with_options(GRANTS_OPTIONS)
def grants_cmd(**cli_values: Any) -> None:
    """Print the GRANT statements for --grant-producer ROLE and --grant-relay ROLE (each
    repeatable; the roles must exist) on a migrated outbox. Nothing is changed."""
    values = settings_for(GRANTS_OPTIONS, cli_values)
    configure_logging(values)
    dsn, names = require_dsn(values), names_from(values)
    chosen = grants.grantees(values["grant_producer"] or (), values["grant_relay"] or ())
    if not chosen:
        raise ConfigError("no role given: pass --grant-producer ROLE and/or --grant-relay ROLE")

    async def body(conn: Conn) -> str:
        return await grants.script(conn, names, chosen)

    click.echo(run(lambda: with_conn(dsn, names, body)))
