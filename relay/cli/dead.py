"""`relay dead list|retry|skip`: dead messages listed and grouped, re-driven or skipped.

An unknown or not-dead id, or a filter that matches nothing, refuses the whole request
before anything changes (a :class:`relay.errors.ConfigError`, one line and exit code 2).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import click

from relay.cli.common import OPS_OPTIONS, AsciiInt, F, check_text, ops_setup, run, with_conn, with_options
from relay.db.names import OutboxNames
from relay.db.readmodel import Conn, DeadFilter
from relay.durations import parse_moment
from relay.errors import ConfigError, shown
from relay.ids import parse_outbox_id
from relay.ops.deadletters import (
    GROUP_KEY,
    GROUPS_PER_PAGE,
    default_operator,
    group_dead,
    list_dead,
    retry,
    select_ids,
    skip,
)
from relay.ops.render import jsonable, refusal_line, render_groups, render_list, render_write

LIST_MAX = 1_000_000  # rows `dead list` prints at most: a table that long is read with --json


# ---- options shared by the dead-letter commands


def _filter_options(func: F) -> F:
    """--event-type, --aggregate, --error, --newer-than, --older-than."""
    options = [
        click.option(
            "--event-type", "f_event_types", multiple=True, metavar="TYPE", help="Only this event type (repeatable)."
        ),
        click.option("--aggregate", "f_aggregate", default=None, metavar="ID", help="Only this aggregate id."),
        click.option(
            "--error", "f_error", default=None, metavar="TEXT", help="Only those whose last error contains TEXT."
        ),
        click.option(
            "--newer-than",
            "f_newer",
            default=None,
            metavar="WHEN",
            help="Only messages created after WHEN: a duration ago (2h) or an ISO time (local unless offset given).",
        ),
        click.option(
            "--older-than", "f_older", default=None, metavar="WHEN", help="Only messages created before WHEN."
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _write_options(func: F) -> F:
    """IDS, the filters, --group, --all, --by, --dry-run, --json."""
    func = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(func)
    func = click.option("--dry-run", is_flag=True, help="Check and show what would change; change nothing.")(func)
    func = click.option(
        "--by", default=None, metavar="WHO", help="Who is acting, recorded with the messages (default: user@host)."
    )(func)
    func = click.option("--all", "all_dead", is_flag=True, help="Every dead message.")(func)
    func = click.option(
        "--group", default=None, metavar="KEY", help="The dead messages of one error group (`relay dead list --group`)."
    )(func)
    func = _filter_options(func)
    return click.argument("ids", nargs=-1)(func)


def _filter(cli_values: dict[str, Any]) -> DeadFilter:
    """Pop the filter flags from ``cli_values`` and check them."""
    now = datetime.now(UTC)
    flt = DeadFilter(
        event_types=tuple(cli_values.pop("f_event_types", ()) or ()),
        aggregate_id=cli_values.pop("f_aggregate", None),
        error=cli_values.pop("f_error", None),
        created_after=parse_moment(cli_values.pop("f_newer", None), "--newer-than", now),
        created_before=parse_moment(cli_values.pop("f_older", None), "--older-than", now),
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


def _selection(ids: tuple[str, ...], group: str | None, all_dead: bool, cli_values: dict[str, Any]) -> Selection:
    """Which dead messages a write names: ids, or a filter and/or group, or --all; exactly one kind."""
    flt = _filter(cli_values)
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
@with_options(OPS_OPTIONS)
@_filter_options
@click.option("--group", "grouped", is_flag=True, help="Group by error fingerprint, with counts.")
@click.option(
    "--limit", type=AsciiInt(1, LIST_MAX), default=100, show_default=True, help=f"Rows to show (1..{LIST_MAX:,})."
)
@click.option(
    "--page",
    type=AsciiInt(1, 1_000_000),
    default=1,
    show_default=True,
    help=f"With --group: which page of {GROUPS_PER_PAGE} groups, largest first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def dead_list_cmd(grouped: bool, limit: int, page: int, as_json: bool, **cli_values: Any) -> None:
    """List dead messages (oldest first), or --group them by error (grouped and counted in
    the database, a page of groups at a time)."""
    flt = _filter(cli_values)
    dsn, names = ops_setup(cli_values)

    async def body(conn: Conn) -> str:
        if grouped:
            groups = await group_dead(conn, names, flt, page=page)
            if as_json:
                return json.dumps({**jsonable(groups), "pages": groups.pages}, indent=2)
            return render_groups(groups, flt)
        listed = await list_dead(conn, names, flt, limit=limit)
        return json.dumps(jsonable(listed), indent=2) if as_json else render_list(listed, flt)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@dead_group.command("retry")
@with_options(OPS_OPTIONS)
@_write_options
@click.option("--reason", default=None, metavar="TEXT", help="Why, recorded with the messages (optional).")
def dead_retry_cmd(
    ids: tuple[str, ...],
    group: str | None,
    all_dead: bool,
    reason: str | None,
    by: str | None,
    dry_run: bool,
    as_json: bool,
    **cli_values: Any,
) -> None:
    """Re-drive dead messages: back to pending, attempts reset, available now, in id order,
    so a dead head's aggregate resumes in order. Give IDS, a filter, --group or --all."""
    check_text(reason, "--reason")
    _dead_write(
        lambda conn, names, chosen, who: retry(conn, names, chosen, by=who, note=reason, dry_run=dry_run),
        ids, group, all_dead, by, as_json, cli_values,
    )  # fmt: skip


@dead_group.command("skip")
@with_options(OPS_OPTIONS)
@_write_options
@click.option("--reason", default=None, metavar="TEXT", help="Why (required), recorded with the messages.")
def dead_skip_cmd(
    ids: tuple[str, ...],
    group: str | None,
    all_dead: bool,
    reason: str | None,
    by: str | None,
    dry_run: bool,
    as_json: bool,
    **cli_values: Any,
) -> None:
    """Mark dead messages finished without delivery, recording who (--by) and why (--reason),
    so the ordered aggregate behind each moves on. Give IDS, a filter, --group or --all."""
    if not reason or not reason.strip():
        raise ConfigError("relay dead skip needs --reason TEXT: it is recorded with the skipped messages")
    check_text(reason, "--reason")
    _dead_write(
        lambda conn, names, chosen, who: skip(conn, names, chosen, by=who, reason=reason, dry_run=dry_run),
        ids, group, all_dead, by, as_json, cli_values,
    )  # fmt: skip


def _dead_write(
    write: Callable[..., Awaitable[Any]],
    ids: tuple[str, ...],
    group: str | None,
    all_dead: bool,
    by: str | None,
    as_json: bool,
    cli_values: dict[str, Any],
) -> None:
    """What `dead retry` and `dead skip` share: pick the rows, write, refuse on any bad id."""
    selection = _selection(ids, group, all_dead, cli_values)
    check_text(by, "--by")
    dsn, names = ops_setup(cli_values)
    who = by or default_operator()

    async def body(conn: Conn) -> str:
        chosen = await _resolve(conn, names, selection)
        result = await write(conn, names, chosen, who)
        if result.refused:
            raise ConfigError(refusal_line(result))
        return json.dumps(jsonable(result), indent=2) if as_json else render_write(result)

    click.echo(run(lambda: with_conn(dsn, names, body)))
