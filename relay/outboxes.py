"""The outboxes one relay process serves, as its config file (``[[outboxes]]``) or
:class:`relay.Relay` (``outboxes=[...]``) lists them.

Each entry names an outbox (``name``: the ``outbox`` label of the metrics, the key of
``/readyz`` and `relay status`) and holds any of `relay start`'s settings for it. What the
file sets outside the entries is every outbox's default, an entry's own value over it;
flags and ``RELAY_*`` variables keep their rank above the file and so apply to every
outbox. Where an outbox is (``dsn``, ``schema``, ``table``) is the entry's own business:
a flag or variable giving it would move every outbox the file lists to one place, so it
is refused; the file's top level may give a default (one database, a schema per tenant),
as may the settings relay.Relay is given beside its list (each entry's own are over them). The settings of
the process itself (the metrics endpoint, logging, tracing) are refused inside an entry.

Nothing here connects: this module turns the listing into one set of option layers per
outbox, for :mod:`relay.compose` to resolve like a single outbox's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relay.errors import ConfigError, shown

OUTBOXES_KEY = "outboxes"
# Names are metric label values and appear in every log line of their outbox: short,
# plain, and a few hundred at most per process.
NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}\Z")
MAX_OUTBOXES = 500
# Where an outbox is: given by each entry (or the file's top level), never by a flag or a
# variable, which would send every outbox to one table.
WHERE = ("dsn", "schema", "table")
# The process's own settings: one metrics endpoint, one log, one tracer for all outboxes.
PROCESS_WIDE = frozenset({"metrics_port", "metrics_host", "log_level", "log_format", "otel"})


@dataclass(frozen=True)
class OutboxEntry:
    """One listed outbox: its name and the option layers that are its own."""

    name: str
    # Python values relay.Relay was given for this outbox (over everything, as given values are).
    given: Mapping[str, Any]
    # The config file as this outbox reads it: the top level with the entry's keys over it
    # (a table such as [ordering] merged key by key).
    file: Mapping[str, Any]
    # How messages name the entry: "relay.toml [[outboxes]] billing".
    where: str


def listed(file: Mapping[str, Any], given: Sequence[Mapping[str, Any]] | None, path: str | None) -> list[OutboxEntry]:
    """The outboxes the config file's ``[[outboxes]]`` or ``given`` (relay.Relay's
    ``outboxes``) list, checked: [] when neither lists any (one outbox, as always)."""
    in_file = file.get(OUTBOXES_KEY)
    if in_file is not None and given:
        raise ConfigError(f"outboxes are listed twice: in {path} ([[outboxes]]) and given to Relay(outboxes=...)")
    if given is not None and not isinstance(given, Sequence | tuple):
        raise ConfigError("outboxes must be a list of mappings, one per outbox")
    raw: Sequence[Any]
    source: str
    if in_file is not None:
        if not isinstance(in_file, list):
            raise ConfigError(f"{path}: outboxes must be an array of tables ([[outboxes]])")
        raw, source = in_file, f"{path} [[outboxes]]"
    else:
        raw, source = list(given or ()), "Relay(outboxes=...)"
    if not raw:
        if in_file is not None or given is not None:
            raise ConfigError(f"{source}: the list of outboxes is empty")
        return []
    if len(raw) > MAX_OUTBOXES:
        raise ConfigError(f"{source}: {len(raw)} outboxes; one process serves at most {MAX_OUTBOXES}")
    top = {k: v for k, v in file.items() if k != OUTBOXES_KEY}
    entries: list[OutboxEntry] = []
    for i, item in enumerate(raw, 1):
        if not isinstance(item, Mapping):
            raise ConfigError(f"{source} #{i}: must be a table of settings")
        name = _name(item.get("name"), f"{source} #{i}")
        own = {k: v for k, v in item.items() if k != "name"}
        where = f"{source} {name}"
        process = sorted(PROCESS_WIDE & set(own))
        if process:
            raise ConfigError(
                f"{where}: {process[0]} is a setting of the process, not of one outbox: set it outside the entries"
            )
        if in_file is not None:
            entries.append(OutboxEntry(name, {}, merged(top, own), where))
        else:
            entries.append(OutboxEntry(name, own, top, where))
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise ConfigError(f"{source}: two outboxes are named {shown(e.name)}")
        seen[e.name] = e.name
    return entries


def chosen_file(file: Mapping[str, Any], name: str | None, path: str | None, *, command: str) -> dict[str, Any]:
    """The config file as one outbox reads it: ``file`` itself when it lists no outboxes,
    else the top level with the entry named ``name`` over it. A file that lists several
    and no ``name`` (``--outbox``, RELAY_OUTBOX) is refused: ``command`` acts on one."""
    entries = listed(file, None, path)
    if not entries:
        if name is not None:
            if not path:
                raise ConfigError(
                    f"--outbox {shown(name)} chooses among the outboxes a config file lists ([[outboxes]]),"
                    " and no --config is given"
                )
            raise ConfigError(f"--outbox {shown(name)}: {path} lists no outboxes ([[outboxes]]) to choose from")
        return dict(file)
    names = [e.name for e in entries]
    if name is None:
        raise ConfigError(
            f"{path} lists {len(entries)} outboxes: choose the one {command} acts on with --outbox NAME"
            f" ({', '.join(names[:10])}{', ...' if len(names) > 10 else ''})"
        )
    for entry in entries:
        if entry.name == name:
            return dict(entry.file)
    raise ConfigError(f"--outbox {shown(name)}: {path} lists no outbox of that name ({', '.join(names[:10])})")


def merged(top: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` with ``own`` over it; a table both hold is merged key by key."""
    out = dict(top)
    for key, value in own.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def refuse_shared_where(cli: Mapping[str, Any], env: Mapping[str, str], variables: Mapping[str, str]) -> None:
    """Refuse a flag (or relay.Relay setting) or a variable that says where the outbox is,
    when several are listed: ``variables`` maps each of :data:`WHERE` to its variable."""
    for dest in WHERE:
        if cli.get(dest) not in (None, ""):
            raise ConfigError(
                f"--{dest} names one outbox, but several are listed: give {dest} in each [[outboxes]] entry"
                " (or at the file's top level, as their default)"
            )
        variable = variables[dest]
        if env.get(variable):
            raise ConfigError(
                f"{variable} names one outbox, but several are listed: unset it and give {dest} in each"
                " [[outboxes]] entry (or at the file's top level, as their default)"
            )


def _name(value: object, where: str) -> str:
    if value is None:
        raise ConfigError(f'{where}: every outbox needs a name (name = "billing")')
    if not isinstance(value, str) or not NAME.match(value):
        raise ConfigError(
            f"{where}: invalid name {shown(str(value))}: lowercase letters, digits, '-' and '_',"
            " at most 63, starting with a letter or digit (it is a metric label)"
        )
    return value
