"""The settings every relay of one outbox shares, stored in ``<table>_settings``.

Three settings live in the database, because the database itself acts on them:

* the **ordering map**: the routing trigger sends each row to the ordered or the unordered
  claim by the map stored at the moment the row is inserted;
* **notify**: whether the producers' insert trigger may send a NOTIFY (wake-ups; it sends
  one only while every relay is idle, see :mod:`relay.wakeup`);
* **commit order**: how the ingest learns the order of producers' commits, by stamp or by
  id (:mod:`relay.db.commit_order`; only `relay settings set` changes it).

Only `relay migrate` (given ordering or notify options) and `relay settings set` change
them, through :func:`relay.db.settings.update_settings`. `relay start` never writes them: it reads them,
runs by them, and warns (:func:`disagreements`) when its own explicitly given options say
otherwise. Every other option belongs to the one process that reads it.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.config import ORDERING_OPTIONS, START_OPTIONS
from relay.db.names import OutboxNames
from relay.db.settings import SettingsChange, SharedSettings, same, show
from relay.options import Option, source_of

# The options of `relay start` (and `relay migrate`) that name a shared setting, by dest.
NOTIFY_OPTION = next(o for o in START_OPTIONS if o.dest == "notify")
SHARED_OPTIONS: tuple[Option, ...] = (*ORDERING_OPTIONS, NOTIFY_OPTION)


# ---- what `relay start` was told, and whether the stored settings agree


@dataclass(frozen=True)
class Given:
    """A shared setting that a relay's own configuration names explicitly (not a default)."""

    setting: str  # an option dest: ordering_default, ordered, unordered, notify
    value: Any  # as the option parsed it
    source: str  # "--ordered", "RELAY_ORDERED" or "config [ordering] ordered"


def given_settings(
    values: Mapping[str, Any],
    cli_values: Mapping[str, Any],
    file: Mapping[str, Any],
    env: Mapping[str, str],
) -> tuple[Given, ...]:
    """The shared settings among ``values`` that came from the command line, a variable or
    the config file (:func:`relay.options.source_of`, as the values were resolved); defaults are left out."""
    found = []
    for o in SHARED_OPTIONS:
        given = source_of(o, cli_values, file, env)
        if given is None:
            continue
        source = _flag(o, values[o.dest]) if given.source == "command line" else given.source
        found.append(Given(o.dest, values[o.dest], source))
    return tuple(found)


def _flag(o: Option, value: Any) -> str:
    if o.kind == "bool":
        return o.flag if value else f"--no-{o.flag[2:]}"
    return o.flag


def set_command(names: OutboxNames, settings: Iterable[tuple[str, Any]]) -> str:
    """The `relay settings set` command that stores ``settings`` (setting, value) for ``names``."""
    words = ["relay", "settings", "set"]
    if names.schema != "public":
        words += ["--schema", names.schema]
    if names.table != "outbox":
        words += ["--table", names.table]
    for setting, value in settings:
        if setting == "notify":
            words.append("--notify" if value else "--no-notify")
        elif setting == "commit_order":
            words += ["--commit-order", str(value)]
        elif setting == "ordering_default":
            words += ["--ordering-default", str(value)]
        else:
            entries = list(value) or [""]  # an empty value empties the list
            for entry in entries:
                words += [f"--{setting}", entry]
    return " ".join(shlex.quote(w) for w in words)


def disagreements(stored: SharedSettings, given: Sequence[Given], names: OutboxNames) -> list[str]:
    """One warning line for each given setting that differs from the stored one, naming
    both values and the command that changes the stored one."""
    lines = []
    where = names.qualified
    for g in given:
        mine, theirs = g.value, stored.value(g.setting)
        if same(g.setting, mine, theirs):
            continue
        fix = set_command(names, [(g.setting, mine)])
        if g.setting == "notify" and not mine:
            lines.append(
                f"{g.source}: this relay does not LISTEN and finds new rows by polling; the stored setting"
                f" notify = true of {where} is unchanged, so producers still NOTIFY and other relays still wake up;"
                f" to turn wake-ups off for every relay: {fix}"
            )
        elif g.setting == "notify":
            lines.append(
                f"{g.source}: the stored setting notify = false of {where} means producers send no wake-ups, so"
                f" this relay polls like the others; to turn wake-ups on for every relay: {fix}"
                " (then restart the relays: each decides at start whether to LISTEN)"
            )
        else:
            label = "ordering default" if g.setting == "ordering_default" else f"{g.setting} list"
            lines.append(
                f"{g.source} {show(g.setting, mine)} differs from the stored {label} {show(g.setting, theirs)}"
                f" of {where}: rows are routed by the stored ordering map when they are inserted, so this relay"
                f" runs by the stored map, not by its own option; to change the stored one: {fix}"
            )
    return lines


def render_text(settings: SharedSettings, names: OutboxNames) -> str:
    """`relay settings show` for people."""
    at = settings.updated_at.isoformat(timespec="seconds") if settings.updated_at else "unknown"
    on, off = "producers NOTIFY while every relay is idle", "producers send no NOTIFY; relays poll"
    wakeups = on if settings.notify else off
    return "\n".join(
        [
            f"shared settings of {names.qualified} (stored in {names.qualified}_settings, last changed {at})",
            f"  ordering default  {settings.value('ordering_default')}",
            f"  ordered           {show('ordered', settings.ordering.ordered)}",
            f"  unordered         {show('unordered', settings.ordering.unordered)}",
            f"  notify            {show('notify', settings.notify)}   ({wakeups})",
            f"  commit order      {settings.commit_order}   ({_COMMIT_ORDER[settings.commit_order]})",
        ]
    )


def render_change(change: SettingsChange, names: OutboxNames) -> str:
    """What an update changed, one ``old -> new`` line per setting."""
    if not change.changed:
        return f"{names.qualified}: shared settings unchanged (already as given)"
    width = max(len(_label(c.setting)) for c in change.changed)
    lines = [f"{names.qualified}: shared settings changed"]
    lines += [f"  {_label(c.setting):<{width}}  {c.old} -> {c.new}" for c in change.changed]
    if any(c.setting in ("ordering_default", "ordered", "unordered") for c in change.changed):
        lines.append("  (rows inserted from now on are routed by the new map; rows already written keep their route)")
    if any(c.setting == "notify" for c in change.changed):
        lines.append("  (relays decide at start whether to LISTEN: restart them to follow a change of notify)")
    if any(c.setting == "commit_order" for c in change.changed):
        lines.append("  (rows committed before the change were numbered by the old rule first; relays follow at once)")
    return "\n".join(lines)


def _label(setting: str) -> str:
    return {"ordering_default": "ordering default", "commit_order": "commit order"}.get(setting, setting)


_COMMIT_ORDER = {
    "stamp": "a commit stamp per producer transaction: right for any producer",
    "id": "by outbox id: producers lock the aggregate before inserting, no commit stamp",
}
