"""`relay settings show|set`: the settings every relay of an outbox shares.

The ordering map and ``notify`` live in ``<table>_settings`` (see
:mod:`relay.shared_settings`); `relay start` only reads them. These commands are where
they are seen and changed. `set` changes only what its own flags name: it reads no
``RELAY_ORDERED``-style variable and no ``[ordering]`` table, so nothing in an operator's
environment or config file changes the fleet by accident (`relay migrate --config FILE`
stores a file's map on purpose).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click

from relay.cli.common import OPS_OPTIONS, ops_target, run, settings_for, with_conn, with_options
from relay.db.commit_order import CommitOrder
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.settings import SettingsUpdate, SharedSettings, read_settings, update_settings
from relay.operator_options import JSON, SETTINGS_SET_OPTIONS
from relay.ops.deadletters import default_operator
from relay.shared_settings import render_change, render_text

log = logging.getLogger("relay.settings")

SHOW_ALL = (*OPS_OPTIONS, JSON)
# Its own flags are command-line only (relay.operator_options says why): no RELAY_ORDERED,
# no [ordering] table reaches them.
SET_ALL = (*OPS_OPTIONS, *SETTINGS_SET_OPTIONS)


@click.group("settings")
def settings_group() -> None:
    """The settings shared by every relay of an outbox: the ordering map and wake-ups."""


@settings_group.command("show")
@with_options(SHOW_ALL)
def show_cmd(**cli_values: Any) -> None:
    """Print the stored ordering map and notify setting."""
    values = settings_for(SHOW_ALL, cli_values)
    dsn, names = ops_target(values)
    as_json: bool = values["json"]

    async def body(conn: Conn) -> str:
        stored = await read_settings(conn, names)
        return json.dumps(_json(stored, names), indent=2) if as_json else render_text(stored, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@settings_group.command("set")
@with_options(SET_ALL)
def set_cmd(**cli_values: Any) -> None:
    """Change the shared settings named by the flags, and only those; prints old -> new.

    Rows inserted from then on are routed by the new map (rows already written keep
    their route). Running relays pick up a change of --notify when restarted, and a change
    of --commit-order at once (it locks the outbox against writes while it switches).
    """
    values = settings_for(SET_ALL, cli_values)
    commit_order: CommitOrder | None = values["settings_commit_order"]
    as_json: bool = values["json"]
    update = SettingsUpdate(
        ordering_default=values["settings_ordering_default"],
        ordered=_entries(values["settings_ordered"]),
        unordered=_entries(values["settings_unordered"]),
        notify=values["settings_notify"],
        commit_order=commit_order,
    )
    if update.is_empty():
        raise click.UsageError(
            "say what to change: --ordering-default, --ordered, --unordered, --notify, --no-notify or --commit-order"
            " (`relay settings show` prints what is stored)"
        )
    dsn, names = ops_target(values)

    async def body(conn: Conn) -> str:
        change = await update_settings(conn, names, update)
        for c in change.changed:
            log.info("shared setting %s of %s changed by %s: %s -> %s", c.setting, names.qualified,
                     default_operator(), c.old, c.new)  # fmt: skip
        if as_json:
            changed = {c.setting: {"old": _value(change.before, c.setting), "new": _value(change.after, c.setting)}
                       for c in change.changed}  # fmt: skip
            return json.dumps({"changed": changed, "settings": _json(change.after, names)}, indent=2)
        return render_change(change, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


def _entries(values: tuple[str, ...]) -> tuple[str, ...] | None:
    """A list flag's entries; None when the flag was not given, () for ``--ordered ''``."""
    if not values:
        return None
    return tuple(v for v in values if v.strip())


def _value(settings: SharedSettings, setting: str) -> Any:
    value = settings.value(setting)
    return list(value) if isinstance(value, tuple) else value


def _json(settings: SharedSettings, names: OutboxNames) -> dict[str, Any]:
    return {"outbox": names.qualified, **settings.to_json()}
