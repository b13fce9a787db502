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

from relay.cli.common import OPS_OPTIONS, ops_setup, run, with_conn, with_options
from relay.db.commit_order import CommitOrder
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.settings import SettingsUpdate, SharedSettings, read_settings, update_settings
from relay.ops.deadletters import default_operator
from relay.shared_settings import render_change, render_text

log = logging.getLogger("relay.settings")


@click.group("settings")
def settings_group() -> None:
    """The settings shared by every relay of an outbox: the ordering map and wake-ups."""


@settings_group.command("show")
@with_options(OPS_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def show_cmd(as_json: bool, **cli_values: Any) -> None:
    """Print the stored ordering map and notify setting."""
    dsn, names = ops_setup(cli_values)

    async def body(conn: Conn) -> str:
        stored = await read_settings(conn, names)
        return json.dumps(_json(stored, names), indent=2) if as_json else render_text(stored, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@settings_group.command("set")
@with_options(OPS_OPTIONS)
@click.option(
    "--ordering-default",
    "s_default",
    type=click.Choice(["ordered", "unordered"]),
    default=None,
    help="Strategy for event types no rule names.",
)
@click.option(
    "--ordered",
    "s_ordered",
    multiple=True,
    metavar="TYPE",
    help="The ordered list: event types or globs ('Order*'); repeatable; replaces the stored list ('' empties it).",
)
@click.option(
    "--unordered",
    "s_unordered",
    multiple=True,
    metavar="TYPE",
    help="The unordered list, likewise.",
)
@click.option(
    "--notify/--no-notify",
    "s_notify",
    default=None,
    help="Whether producers' inserts NOTIFY the relays (off behind a transaction-mode pooler).",
)
@click.option(
    "--commit-order",
    "s_commit_order",
    type=click.Choice(["stamp", "id"]),
    default=None,
    help="How commit order is learned: 'stamp' (any producer; the default) or 'id' (every producer locks the"
    " aggregate before inserting: cheaper inserts). Run as the table's owner; see docs/concepts/ordering.md.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def set_cmd(
    s_default: str | None,
    s_ordered: tuple[str, ...],
    s_unordered: tuple[str, ...],
    s_notify: bool | None,
    s_commit_order: CommitOrder | None,
    as_json: bool,
    **cli_values: Any,
) -> None:
    """Change the shared settings named by the flags, and only those; prints old -> new.

    Rows inserted from then on are routed by the new map (rows already written keep
    their route). Running relays pick up a change of --notify when restarted, and a change
    of --commit-order at once (it locks the outbox against writes while it switches).
    """
    update = SettingsUpdate(
        ordering_default=s_default,
        ordered=_entries(s_ordered),
        unordered=_entries(s_unordered),
        notify=s_notify,
        commit_order=s_commit_order,
    )
    if update.is_empty():
        raise click.UsageError(
            "say what to change: --ordering-default, --ordered, --unordered, --notify, --no-notify or --commit-order"
            " (`relay settings show` prints what is stored)"
        )
    dsn, names = ops_setup(cli_values)

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
