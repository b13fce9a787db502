"""Operator commands of the ``relay`` CLI: status, explain, dead list|retry|skip, release, prune.

Each takes ``--dsn``, ``--schema``, ``--table``, ``--config``, ``--log-level`` and
``--log-format`` the way `relay migrate` does. Bad input (an unknown or not-dead id, a
filter that matches nothing, a malformed duration) raises :class:`relay.errors.ConfigError`
or a click usage error before anything changes, and ``relay.cli.main`` prints it as one
line with exit code 2. Database errors are turned into one masked line as well.

:func:`register` adds the commands to the ``relay`` group; ``relay.cli`` calls it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import click
import psycopg

from relay import logs
from relay.config import CORE_OPTIONS, LOG_OPTIONS, START_OPTIONS, names_from, require_dsn
from relay.db import check_schema, connect
from relay.dsn import describe_dsn, mask
from relay.durations import format_bound, format_duration, is_duration_syntax, parse_duration
from relay.errors import ConfigError, DatabaseUnavailable, first_line, shown
from relay.ids import parse_outbox_id
from relay.ops.deadletters import default_operator, group_dead, list_dead, retry, select_ids, skip
from relay.ops.explain import explain
from relay.ops.prune import DEFAULT_BATCH, prune
from relay.ops.queries import Conn, DeadFilter
from relay.ops.release import parse_ids, release
from relay.ops.render import (
    jsonable,
    refusal_line,
    render_explanation,
    render_groups,
    render_list,
    render_prune,
    render_release,
    render_status,
    render_write,
    to_json,
)
from relay.ops.status import read_status
from relay.sqlnames import OutboxNames

OPS_OPTIONS = (*CORE_OPTIONS, *LOG_OPTIONS)
# A release judges spent attempts as the relays' reaper does: by their --max-attempts
# (same flag, variable and config key, so `--config relay.toml` gives the fleet's value).
RELEASE_OPTIONS = (*OPS_OPTIONS, *(o for o in START_OPTIONS if o.dest == "max_attempts"))
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen: --watch redraws in place
_GROUP_KEY = re.compile(r"[0-9a-f]{8}")
_DIGITS = re.compile(r"[0-9]{1,19}")  # a count: ASCII digits, as ids (relay.ids)
LIST_MAX = 1_000_000  # rows `dead list` prints at most: a table that long is read with --json
# `status --watch`: faster than 100 ms is a busy loop on the database; slower than an hour
# is not watching.
WATCH_MIN, WATCH_MAX = timedelta(milliseconds=100), timedelta(hours=1)

T = TypeVar("T")
F = Callable[..., Any]


class AsciiInt(click.types.IntParamType):
    """A whole number in ASCII digits within ``low``..``high``: click.INT, like int(), also
    takes "1_0" (10) and "\u0661" (an Arabic-Indic 1)."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        elif isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
            number = int(value.strip())
        else:
            self.fail(f"{shown(value)} is not a whole number (ASCII digits)", param, ctx)
        if not self.low <= number <= self.high:
            self.fail(f"{number} is not in the range {self.low}..{self.high:,}", param, ctx)
        return number


def register(cli: click.Group) -> None:
    """Add the operator commands to ``cli`` (the ``relay`` group)."""
    # Imported here: relay.cli imports this module while it is being defined.
    from relay.cli import settings_for, with_options

    def setup(cli_values: dict[str, Any]) -> tuple[str, OutboxNames]:
        values = settings_for(OPS_OPTIONS, cli_values)
        logs.configure(values["log_level"], values["log_format"])
        return require_dsn(values), names_from(values)

    @cli.command("status")
    @with_options(OPS_OPTIONS)
    @click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per refresh).")
    @click.option("--by-event-type", is_flag=True, help="Break the unfinished messages down by event type.")
    @click.option("--watch", is_flag=True, help="Redraw in place every --interval until Ctrl-C.")
    @click.option(
        "--interval",
        default="2s",
        metavar="DURATION",
        show_default=True,
        help=f"Refresh period of --watch ({format_bound(WATCH_MIN)}..{format_bound(WATCH_MAX)}).",
    )
    def status_cmd(as_json: bool, by_event_type: bool, watch: bool, interval: str, **cli_values: Any) -> None:
        """Is the relay keeping up? Counts, oldest waiting message, expired leases, attempts,
        blocked ordered aggregates (reads only unfinished rows; done is an estimate)."""
        period = parse_duration(interval, name="--interval", minimum=WATCH_MIN, maximum=WATCH_MAX)
        dsn, names = setup(cli_values)
        where = describe_dsn(dsn)

        async def frame(conn: Conn) -> str:
            status = await read_status(conn, names, by_event_type=by_event_type)
            return json.dumps(to_json(status)) if as_json else render_status(status, names, where)

        if not watch:
            click.echo(_run(lambda: _with_conn(dsn, names, frame)))
            return
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends: exit 0
            _run(lambda: _watch(dsn, names, frame, period, as_json))

    @cli.command("explain")
    @with_options(OPS_OPTIONS)
    @click.argument("aggregate_id")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    def explain_cmd(aggregate_id: str, as_json: bool, **cli_values: Any) -> None:
        """Why AGGREGATE_ID's ordered messages are or are not moving: its head message, status,
        attempts, last error, next eligible time, lease, and how many wait behind it."""
        _check_text(aggregate_id, "AGGREGATE_ID")
        dsn, names = setup(cli_values)

        async def body(conn: Conn) -> str:
            e = await explain(conn, names, aggregate_id)
            return json.dumps(jsonable(e), indent=2) if as_json else render_explanation(e, names)

        click.echo(_run(lambda: _with_conn(dsn, names, body)))

    @cli.group("dead")
    def dead_group() -> None:
        """Dead messages: list and group them, re-drive them in order, or skip them."""

    @dead_group.command("list")
    @with_options(OPS_OPTIONS)
    @_filter_options
    @click.option("--group", "grouped", is_flag=True, help="Group by error fingerprint, with counts.")
    @click.option(
        "--limit", type=AsciiInt(1, LIST_MAX), default=100, show_default=True, help=f"Rows to show (1..{LIST_MAX:,})."
    )
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    def dead_list_cmd(grouped: bool, limit: int, as_json: bool, **cli_values: Any) -> None:
        """List dead messages (oldest first), or --group them by error."""
        flt = _filter(cli_values)
        dsn, names = setup(cli_values)

        async def body(conn: Conn) -> str:
            if grouped:
                groups = await group_dead(conn, names, flt)
                return json.dumps(jsonable(groups), indent=2) if as_json else render_groups(groups, flt)
            page = await list_dead(conn, names, flt, limit=limit)
            return json.dumps(jsonable(page), indent=2) if as_json else render_list(page, flt)

        click.echo(_run(lambda: _with_conn(dsn, names, body)))

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
        _check_text(reason, "--reason")
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
        _check_text(reason, "--reason")
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
        _check_text(by, "--by")
        dsn, names = setup(cli_values)
        who = by or default_operator()

        async def body(conn: Conn) -> str:
            chosen = await _resolve(conn, names, selection)
            result = await write(conn, names, chosen, who)
            if result.refused:
                raise ConfigError(refusal_line(result))
            return json.dumps(jsonable(result), indent=2) if as_json else render_write(result)

        click.echo(_run(lambda: _with_conn(dsn, names, body)))

    @cli.command("prune")
    @with_options(OPS_OPTIONS)
    @click.option(
        "--older-than",
        "older_than",
        default=None,
        metavar="DURATION",
        help="Delete done rows finished longer ago than this (e.g. 7d). Required.",
    )
    @click.option("--include-dead", is_flag=True, help="Also delete dead rows created before the cutoff.")
    @click.option(
        "--chunk-size",
        type=AsciiInt(1, 100_000),
        default=DEFAULT_BATCH,
        show_default=True,
        help="Ids per delete statement (each its own short transaction).",
    )
    @click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    def prune_cmd(
        older_than: str | None, include_dead: bool, chunk_size: int, dry_run: bool, as_json: bool, **cli_values: Any
    ) -> None:
        """Delete finished rows older than --older-than in small batches (dead rows are kept
        unless --include-dead); prints what it removed."""
        if older_than is None:
            raise ConfigError("relay prune needs --older-than DURATION (for example 7d): rows finished before then go")
        age = parse_duration(older_than, name="--older-than")  # 0 is allowed: every done row goes
        dsn, names = setup(cli_values)

        async def body(conn: Conn) -> str:
            result = await prune(conn, names, age, include_dead=include_dead, batch=chunk_size, dry_run=dry_run)
            if as_json:
                return json.dumps({**jsonable(result), "older_than": age.total_seconds(), "deleted": result.deleted})
            return render_prune(result, names)

        click.echo(_run(lambda: _with_conn(dsn, names, body)))

    @cli.command("release")
    @with_options(RELEASE_OPTIONS)
    @click.option(
        "--owner",
        default=None,
        metavar="OWNER",
        help="Lease owner (host:pid:worker), or a host or host:pid for all its workers.",
    )
    @click.option("--ids", "id_lists", multiple=True, metavar="1,2,3", help="Outbox ids (comma-separated, repeatable).")
    @click.option("--yes", is_flag=True, help="Release them; without it, only show what would be released.")
    @click.option(
        "--by", default=None, metavar="WHO", help="Who is acting, recorded with the messages (default: user@host)."
    )
    @click.option("--reason", default=None, metavar="TEXT", help="Why, recorded with the messages (optional).")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
    def release_cmd(
        owner: str | None,
        id_lists: tuple[str, ...],
        yes: bool,
        by: str | None,
        reason: str | None,
        as_json: bool,
        **cli_values: Any,
    ) -> None:
        """Hand back the leases of a worker that is gone (a crashed host), before they expire:
        its processing rows go back to pending (dead if their attempts are spent, as when a
        lease expires), lease_version + 1 so its late finalize writes nothing. Without --yes,
        only shows what it would release."""
        if owner is not None and not owner.strip():
            raise ConfigError("invalid --owner: must not be empty")
        ids = parse_ids(id_lists)
        if owner is None and not ids:
            raise click.UsageError(
                "say whose leases to release: --owner OWNER or --ids 1,2,3 (`relay status` counts them)"
            )
        values = settings_for(RELEASE_OPTIONS, cli_values)
        logs.configure(values["log_level"], values["log_format"])
        dsn, names = require_dsn(values), names_from(values)
        who = by or default_operator()

        async def body(conn: Conn) -> str:
            result = await release(
                conn, names, owner=owner, ids=ids, by=who, note=reason,
                max_attempts=values["max_attempts"], dry_run=not yes,
            )  # fmt: skip
            return json.dumps(jsonable(result), indent=2) if as_json else render_release(result, names)

        click.echo(_run(lambda: _with_conn(dsn, names, body)))


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


def _when(value: str | None, flag: str, now: datetime) -> datetime | None:
    """``value`` as a moment: a duration ago, or an ISO time (local unless it has an offset)."""
    if value is None:
        return None
    if is_duration_syntax(value):
        # Bounded (at most MAX_DURATION), so "now minus it" stays a valid date.
        return now - parse_duration(value, name=flag)
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(
            f"invalid {flag}: {shown(value)} (expected a duration such as 30m, 2h, 7d, or an ISO time such as"
            " 2024-05-01T12:00+00:00)"
        ) from None
    if parsed.tzinfo:
        return parsed
    try:
        return parsed.astimezone()
    except (ValueError, OverflowError):  # local time at the very ends of years 1 and 9999
        raise ConfigError(
            f"invalid {flag}: {shown(value)} is out of range in the local time zone; give an offset such as +00:00"
        ) from None


def _filter(cli_values: dict[str, Any]) -> DeadFilter:
    """Pop the filter flags from ``cli_values`` and check them."""
    now = datetime.now(UTC)
    flt = DeadFilter(
        event_types=tuple(cli_values.pop("f_event_types", ()) or ()),
        aggregate_id=cli_values.pop("f_aggregate", None),
        error=cli_values.pop("f_error", None),
        created_after=_when(cli_values.pop("f_newer", None), "--newer-than", now),
        created_before=_when(cli_values.pop("f_older", None), "--older-than", now),
    )
    for event_type in flt.event_types:
        _check_text(event_type, "--event-type")
    _check_text(flt.aggregate_id, "--aggregate")
    _check_text(flt.error, "--error")
    if any(not t.strip() for t in flt.event_types):
        raise ConfigError("invalid --event-type: must not be empty")
    if flt.error is not None and not flt.error.strip():
        raise ConfigError("invalid --error: must not be empty")
    if flt.created_after and flt.created_before and flt.created_after >= flt.created_before:
        raise ConfigError("--newer-than and --older-than leave no time between them: nothing could match")
    return flt


def _check_text(value: str | None, what: str) -> None:
    """Refuse text the database could not take. Bytes that are not UTF-8 in an argument
    reach Python as lone surrogates, which no client encoding can send."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ConfigError(f"invalid {what}: not UTF-8 text (character {exc.start + 1} of {len(value):,})") from None


Selection = tuple[list[int], DeadFilter, str | None]


def _selection(ids: tuple[str, ...], group: str | None, all_dead: bool, cli_values: dict[str, Any]) -> Selection:
    """Which dead messages a write names: ids, or a filter and/or group, or --all; exactly one kind."""
    flt = _filter(cli_values)
    numbers = []
    for raw in ids:
        numbers.append(parse_outbox_id(raw))
    if group is not None and not _GROUP_KEY.fullmatch(group):
        raise ConfigError(
            f"invalid --group {shown(group)}: expected the 8-character key `relay dead list --group` shows"
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


# ---- running


async def _with_conn(dsn: str, names: OutboxNames, body: Callable[[Conn], Awaitable[T]]) -> T:
    conn = await connect(dsn)
    async with conn:
        await check_schema(conn, names)
        return await body(conn)


async def _watch(
    dsn: str, names: OutboxNames, frame: Callable[[Conn], Awaitable[str]], period: timedelta, as_json: bool
) -> None:
    """Redraw ``frame`` every ``period`` until interrupted; a lost database shows in the frame
    and is retried on the next tick (the first connection must succeed)."""
    conn: Conn | None = await connect(dsn)
    assert conn is not None
    await check_schema(conn, names)
    footer = f"\n\nrefreshing every {format_duration(period)}; Ctrl-C to stop"
    in_place = sys.stdout.isatty() and not as_json
    try:
        while True:
            try:
                if conn is None or conn.closed:
                    conn = await connect(dsn)
                text = await frame(conn)
            except (DatabaseUnavailable, psycopg.OperationalError) as exc:
                if conn is not None:
                    await conn.close()
                conn = None
                text = json.dumps({"error": _first_line(exc)}) if as_json else f"database error: {_first_line(exc)}"
            if as_json:
                click.echo(text)
            elif in_place:
                click.echo(CLEAR_SCREEN + text + footer, nl=False)
            else:  # piped or redirected: one frame after another, no escape codes
                click.echo(text + "\n")
            sys.stdout.flush()
            await asyncio.sleep(period.total_seconds())
    finally:
        if conn is not None:
            await conn.close()
        if in_place:
            click.echo("")


def _first_line(exc: BaseException) -> str:
    return mask(first_line(exc))


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a command's coroutine; database errors become one masked line (exit code 2)."""
    try:
        return asyncio.run(make())
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"database error: {_first_line(exc)}") from None
    except psycopg.Error as exc:
        raise ConfigError(f"the database refused the request: {_first_line(exc)}") from None
