"""`relay dead list|retry|skip`: dead messages listed and grouped, re-driven or skipped.

An unknown or not-dead id, or a filter that matches nothing, refuses the whole request
before anything changes (a :class:`relay.errors.ConfigError`, one line and exit code 2).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import click

from relay.cli.common import OPS_OPTIONS, check_text, ops_target, run, settings_for, with_conn, with_options
from relay.db.names import OutboxNames
from relay.db.readmodel import Conn, DeadFilter
from relay.durations import parse_moment
from relay.errors import ConfigError, shown
from relay.ids import parse_outbox_id
from relay.operator_options import (
    BY,
    DEAD_FILTER_OPTIONS,
    DEAD_LIST_OPTIONS,
    DEAD_SELECT_OPTIONS,
    DRY_RUN,
    JSON,
    REASON,
)
from relay.ops.deadletters import (
    GROUP_KEY,
    default_operator,
    group_dead,
    list_dead,
    retry,
    select_ids,
    skip,
)
from relay.ops.render import jsonable, refusal_line, render_groups, render_list, render_write

# Each command's options, in the order --help lists them.
DEAD_LIST_ALL = (*OPS_OPTIONS, *DEAD_FILTER_OPTIONS, *DEAD_LIST_OPTIONS)
_WRITE = (*OPS_OPTIONS, *DEAD_FILTER_OPTIONS, *DEAD_SELECT_OPTIONS, BY, DRY_RUN, JSON)
DEAD_RETRY_ALL = (*_WRITE, REASON)
DEAD_SKIP_ALL = (*_WRITE, replace(REASON, help="Why (required), recorded with the messages."))


def _filter(values: dict[str, Any]) -> DeadFilter:
    """Pop the filters (``f_event_types``, ``f_aggregate``, ``f_error``, ``f_newer``,
    ``f_older``) from a command's ``values`` and check them."""
    now = datetime.now(UTC)
    flt = DeadFilter(
        event_types=tuple(values.pop("f_event_types", ()) or ()),
        aggregate_id=values.pop("f_aggregate", None),
        error=values.pop("f_error", None),
        created_after=parse_moment(values.pop("f_newer", None), "--newer-than", now),
        created_before=parse_moment(values.pop("f_older", None), "--older-than", now),
    )
    for event_type in flt.event_types:
        check_text(event_type, "--event-type")
    check_text(flt.aggregate_id, "--aggregate")
    check_text(flt.error, "--error")
    if any(not t.strip() for t in flt.event_types):
        raise ConfigError("invalid --event-type: must not be empty")
    if flt.error is not None and not flt.error.strip():
        raise ConfigError("invalid --error: must not be empty")
    if flt.created_after and flt.created_before and flt.created_after >= flt.created_before:
        raise ConfigError("--newer-than and --older-than leave no time between them: nothing could match")
    return flt


Selection = tuple[list[int], DeadFilter, str | None]


def _selection(ids: tuple[str, ...], group: str | None, all_dead: bool, values: dict[str, Any]) -> Selection:
    """Which dead messages a write names: ids, or a filter (in ``values``) and/or group, or
    --all; exactly one kind."""
    flt = _filter(values)
    numbers = []
    for raw in ids:
        numbers.append(parse_outbox_id(raw))
    if group is not None and not GROUP_KEY.fullmatch(group):
        raise ConfigError(
            f"invalid --group {shown(group)}: expected the 16-character key `relay dead list --group` shows"
            " (keys shown before migration 0014 had 8)"
        )
    by_filter = not flt.is_empty() or group is not None
    if sum((bool(numbers), by_filter, all_dead)) > 1:
        raise click.UsageError("give ids, or a filter/--group, or --all: not more than one of them")
    if not (numbers or by_filter or all_dead):
        raise click.UsageError(
            "say which dead messages: ids (relay dead retry 41 42), a filter (--event-type, --aggregate, --error,"
            " --newer-than, --older-than), --group KEY, or --all"
        )
    return numbers, flt, group


async def _resolve(conn: Conn, names: OutboxNames, selection: Selection) -> list[int]:
    numbers, flt, group = selection
    if numbers:
        return numbers
    return await select_ids(conn, names, flt, group)


# ---- the commands


@click.group("dead")
def dead_group() -> None:
    """Dead messages: list and group them, re-drive them in order, or skip them."""


@dead_group.command("list")
@with_options(DEAD_LIST_ALL)
def dead_list_cmd(**cli_values: Any) -> None:
    """List dead messages (oldest first), or --group them by error (grouped and counted in
    the database, a page of groups at a time)."""
    values = settings_for(DEAD_LIST_ALL, cli_values)
    flt = _filter(values)
    dsn, names = ops_target(values)
    as_json: bool = values["json"]

    async def body(conn: Conn) -> str:
        if values["dead_grouped"]:
            groups = await group_dead(conn, names, flt, page=values["dead_page"])
            if as_json:
                return json.dumps({**jsonable(groups), "pages": groups.pages}, indent=2)
            return render_groups(groups, flt)
        listed = await list_dead(conn, names, flt, limit=values["dead_limit"])
        return json.dumps(jsonable(listed), indent=2) if as_json else render_list(listed, flt)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@dead_group.command("retry")
@with_options(DEAD_RETRY_ALL)
@click.argument("ids", nargs=-1)
def dead_retry_cmd(ids: tuple[str, ...], **cli_values: Any) -> None:
    """Re-drive dead messages: back to pending, attempts reset, available now, in id order,
    so a dead head's aggregate resumes in order. Give IDS, a filter, --group or --all."""
    values = settings_for(DEAD_RETRY_ALL, cli_values)
    reason: str | None = values["reason"]
    check_text(reason, "--reason")
    dry_run: bool = values["dry_run"]
    _dead_write(
        lambda conn, names, chosen, who: retry(conn, names, chosen, by=who, note=reason, dry_run=dry_run),
        ids, values,
    )  # fmt: skip


@dead_group.command("skip")
@with_options(DEAD_SKIP_ALL)
@click.argument("ids", nargs=-1)
def dead_skip_cmd(ids: tuple[str, ...], **cli_values: Any) -> None:
    """Mark dead messages finished without delivery, recording who (--by) and why (--reason),
    so the ordered aggregate behind each moves on. Give IDS, a filter, --group or --all."""
    values = settings_for(DEAD_SKIP_ALL, cli_values)
    reason: str | None = values["reason"]
    if not reason or not reason.strip():
        raise ConfigError("relay dead skip needs --reason TEXT: it is recorded with the skipped messages")
    check_text(reason, "--reason")
    dry_run: bool = values["dry_run"]
    _dead_write(
        lambda conn, names, chosen, who: skip(conn, names, chosen, by=who, reason=reason, dry_run=dry_run),
        ids, values,
    )  # fmt: skip


def _dead_write(write: Callable[..., Awaitable[Any]], ids: tuple[str, ...], values: dict[str, Any]) -> None:
    """What `dead retry` and `dead skip` share: pick the rows, write, refuse on any bad id."""
    selection = _selection(ids, values["dead_group"], values["dead_all"], values)
    by: str | None = values["by"]
    check_text(by, "--by")
    dsn, names = ops_target(values)
    who = by or default_operator()
    as_json: bool = values["json"]

    async def body(conn: Conn) -> str:
        chosen = await _resolve(conn, names, selection)
        result = await write(conn, names, chosen, who)
        if result.refused:
            raise ConfigError(refusal_line(result))
        return json.dumps(jsonable(result), indent=2) if as_json else render_write(result)

    click.echo(run(lambda: with_conn(dsn, names, body)))
