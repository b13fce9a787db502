"""`relay migrate`: create or upgrade the outbox table, and store shared settings if asked."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC
from typing import Any

import click
import psycopg

from relay.cli.common import configure_logging, settings_for, with_options
from relay.config import (
    CORE_OPTIONS,
    GRANT_OPTIONS,
    LOG_OPTIONS,
    ORDERING_OPTIONS,
    names_from,
    ordering_from,
    require_dsn,
)
from relay.db import grants
from relay.db.migrate import migrate as apply_migrations
from relay.db.migrate import pg_message
from relay.db.partitions import PartitionSpec
from relay.db.session import connect
from relay.db.settings import SettingsUpdate, update_settings
from relay.errors import ConfigError
from relay.operator_options import MIGRATE_PARTITION_OPTIONS
from relay.shared_settings import SHARED_OPTIONS, render_change

# For migrate, the shared settings' options default to "not given": only a map (or a
# notify) someone asked for replaces the stored one.
MIGRATE_OPTIONS = (
    *CORE_OPTIONS,
    *(replace(o, default=None) for o in SHARED_OPTIONS),
    *GRANT_OPTIONS,
    *MIGRATE_PARTITION_OPTIONS,
    *LOG_OPTIONS,
)


@click.command("migrate")
@with_options(MIGRATE_OPTIONS)
def migrate_cmd(**cli_values: Any) -> None:
    """Create or upgrade the outbox table (idempotent; safe to run concurrently).

    With --ordering-default/--ordered/--unordered (or an [ordering] table in --config), also
    store that ordering map, so rows are routed by it from then on; with --notify/--no-notify,
    store whether producers' inserts wake the relays. Both are shared by every relay of the
    outbox (`relay settings show`); without these options the stored settings stay as they are.
    With --partition-by id --partition-size N (or --partition-by time --partition-interval 1d),
    make a new (or empty) outbox range-partitioned by id (or by created_at); on a partitioned
    outbox every run creates the partitions missing ahead.
    With --grant-producer ROLE / --grant-relay ROLE (repeatable), grant those existing roles
    what producers and relays need, and nothing more (`relay grants` prints the SQL instead).
    """
    values = settings_for(MIGRATE_OPTIONS, cli_values)
    configure_logging(values)
    dsn, names = require_dsn(values), names_from(values)
    given = any(values[o.dest] not in (None, ()) for o in ORDERING_OPTIONS)
    ordering = ordering_from(values) if given else None
    if ordering is not None:
        update: SettingsUpdate | None = SettingsUpdate.whole_map(ordering, notify=values["notify"])
    else:
        update = SettingsUpdate(notify=values["notify"]) if values["notify"] is not None else None

    partitioning = None
    by, size, span = values["partition_by"], values["partition_size"], values["partition_interval"]
    if by == "id":
        if size is None:
            raise ConfigError("--partition-by id needs --partition-size N (ids per partition, e.g. 1000000)")
        if span is not None:
            raise ConfigError("--partition-interval is for --partition-by time, not id")
        partitioning = PartitionSpec(size=size, ahead=values["partitions_ahead"])
    elif by == "time":
        if span is None:
            raise ConfigError("--partition-by time needs --partition-interval (created_at span per partition, e.g. 1d)")
        if size is not None:
            raise ConfigError("--partition-size is for --partition-by id, not time")
        partitioning = PartitionSpec(span=span, ahead=values["partitions_ahead"])
    elif size is not None:
        raise ConfigError("--partition-size is for --partition-by id: give both, or neither")
    elif span is not None:
        raise ConfigError("--partition-interval is for --partition-by time: give both, or neither")

    chosen = grants.grantees(values["grant_producer"] or (), values["grant_relay"] or ())

    async def run() -> None:
        conn = await connect(dsn)
        async with conn:
            # A misspelt role is refused before anything is migrated.
            await grants.database_for(conn, chosen)
            result = await apply_migrations(conn, names, partitioning)
            if chosen:
                try:
                    await grants.grant(conn, names, chosen)
                except psycopg.Error as exc:
                    why = pg_message(exc)
                    raise ConfigError(f"cannot grant the roles' privileges on {names.qualified}: {why}") from None
            try:
                change = await update_settings(conn, names, update) if update is not None else None
            except psycopg.Error as exc:
                why = pg_message(exc)
                raise ConfigError(f"cannot store the shared settings of {names.qualified}: {why}") from None
        for label in result.applied:
            click.echo(f"{names.qualified}: applied {label}")
        if not result.applied:
            click.echo(f"{names.qualified}: up to date ({len(result.already)} migrations applied earlier)")
        if result.partitioned is not None and result.partitioned.converted:
            click.echo(
                f"{names.qualified}: partitioned {result.partitioned.spec.describe()},"
                f" {result.partitioned.ahead} kept ahead"
            )
        if result.ahead is not None:
            made = ", ".join(result.ahead.created) or "none missing"
            if result.ahead.covered_until is not None:
                until = result.ahead.covered_until.astimezone(UTC).isoformat(timespec="minutes")
                click.echo(f"{names.qualified}: partitions ahead: {made}; rows created before {until} have a partition")
            else:
                click.echo(
                    f"{names.qualified}: partitions ahead: {made}; ids up to {(result.ahead.covered_to or 1) - 1:,}"
                    f" have a partition (next id {result.ahead.next_id:,})"
                )
        if ordering is not None:
            click.echo(f"{names.qualified}: ordering map stored: {ordering.describe()}")
        if change is not None:
            click.echo(render_change(change, names))
        for grantee in chosen:
            click.echo(f"{names.qualified}: granted {grantee.kind} privileges to role {grantee.role!r}")

    asyncio.run(run())
