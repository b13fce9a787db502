"""`relay status`, `relay explain`, `relay prune` and `relay release`: the operator commands
that read an outbox or change it by one rule (`relay dead` is in :mod:`relay.cli.dead`).

Bad input (a filter that matches nothing, a malformed duration) raises
:class:`relay.errors.ConfigError` or a click usage error before anything changes, and
:func:`relay.cli.main.main` prints it as one line with exit code 2. Database errors are
turned into one masked line as well (:func:`relay.cli.common.run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import click
import psycopg

from relay.cli.common import (
    BROKER_OPTIONS,
    OPS_OPTIONS,
    AsciiInt,
    bounded_duration_option,
    check_text,
    configure_logging,
    masked_first_line,
    ops_setup,
    run,
    settings_for,
    with_conn,
    with_options,
)
from relay.config import START_OPTIONS, names_from, require_dsn
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.session import check_schema, connect
from relay.dsn import describe_dsn
from relay.durations import format_duration, parse_duration
from relay.errors import ConfigError, DatabaseUnavailable, shown
from relay.ops import deadletters
from relay.ops.deadletters import default_operator
from relay.ops.explain import explain
from relay.ops.release import parse_ids, release
from relay.ops.render import jsonable, render_explanation, render_prune, render_release, render_status, to_json
from relay.ops.status import read_status
from relay.options import load_file, resolve
from relay.retention import DEFAULT_BATCH, SkipBlocking, prune
from relay.routes import ROUTES_OPTION, destination_namer

# A release judges spent attempts as the relays' reaper does: by their --max-attempts
# (same flag, variable and config key, so `--config relay.toml` gives the fleet's value).
RELEASE_OPTIONS = (*OPS_OPTIONS, *(o for o in START_OPTIONS if o.dest == "max_attempts"))
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen: --watch redraws in place
# `status --watch`: faster than 100 ms is a busy loop on the database; slower than an hour
# is not watching.
WATCH_MIN, WATCH_MAX = timedelta(milliseconds=100), timedelta(hours=1)


@click.command("status")
@with_options(OPS_OPTIONS)
@click.option("--json", "as_json", is_flag=True, help="One JSON object (with --watch: one per refresh).")
@click.option("--by-event-type", is_flag=True, help="Break the unfinished messages down by event type.")
@click.option("--watch", is_flag=True, help="Redraw in place every --interval until Ctrl-C.")
@bounded_duration_option("--interval", "2s", (WATCH_MIN, WATCH_MAX), "Refresh period of --watch")
def status_cmd(as_json: bool, by_event_type: bool, watch: bool, interval: str, **cli_values: Any) -> None:
    """Is the relay keeping up? Counts, oldest waiting message, expired leases, attempts,
    blocked ordered aggregates (reads only unfinished rows; done is an estimate)."""
    period = parse_duration(interval, name="--interval", minimum=WATCH_MIN, maximum=WATCH_MAX)
    destination_of = _destinations(cli_values.get("config_path")) if by_event_type else None
    dsn, names = ops_setup(cli_values)
    where = describe_dsn(dsn)

    async def frame(conn: Conn) -> str:
        status = await read_status(conn, names, by_event_type=by_event_type, destination_of=destination_of)
        return json.dumps(to_json(status)) if as_json else render_status(status, names, where)

    if not watch:
        click.echo(run(lambda: with_conn(dsn, names, frame)))
        return
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends: exit 0
        run(lambda: _watch(dsn, names, frame, period, as_json))


def _destinations(config_path: str | None) -> Callable[[str], str] | None:
    """Each event type's destination under the broker, routes and default destination that
    `relay start` would read from the same config file and RELAY_* variables; None when
    they name no broker."""
    options = (*(o for o in START_OPTIONS if o.dest == "broker"), ROUTES_OPTION, *BROKER_OPTIONS)
    return destination_namer(resolve(options, {}, load_file(config_path)))


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
                error = masked_first_line(exc)
                text = json.dumps({"error": error}) if as_json else f"database error: {error}"
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


@click.command("explain")
@with_options(OPS_OPTIONS)
@click.argument("aggregate_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def explain_cmd(aggregate_id: str, as_json: bool, **cli_values: Any) -> None:
    """Why AGGREGATE_ID's ordered messages are or are not moving: its head message, status,
    attempts, last error, next eligible time, lease, and how many wait behind it."""
    check_text(aggregate_id, "AGGREGATE_ID")
    dsn, names = ops_setup(cli_values)

    async def body(conn: Conn) -> str:
        e = await explain(conn, names, aggregate_id)
        return json.dumps(jsonable(e), indent=2) if as_json else render_explanation(e, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


MIN_HEADS_IDLE = timedelta(hours=1)  # the error below says 1h


@click.command("prune")
@with_options(OPS_OPTIONS)
@click.option(
    "--older-than",
    "older_than",
    default=None,
    metavar="DURATION",
    help="Delete done rows finished longer ago than this (e.g. 7d). Required.",
)
@click.option(
    "--include-dead",
    is_flag=True,
    help="Also delete dead unordered rows created before the cutoff. Dead ordered rows are kept"
    " (each stops its aggregate): they are counted and their aggregates named.",
)
@click.option(
    "--skip-blocking",
    is_flag=True,
    help="With --include-dead: skip the dead ordered rows created before the cutoff, recorded as"
    " `relay dead skip` records them (needs --reason), which unblocks their aggregates.",
)
@click.option("--reason", default=None, metavar="TEXT", help="Why --skip-blocking skips them (recorded).")
@click.option("--by", default=None, metavar="WHO", help="Who skips (recorded; default: user@host).")
@click.option(
    "--heads-idle-for",
    "heads_idle_for",
    default=None,
    metavar="DURATION",
    help="Also forget the aggregate_seq counter of every ordered aggregate with nothing unfinished that numbered"
    " nothing for this long (e.g. 90d): it starts again at 1 if it comes back. Off unless given.",
)
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
    older_than: str | None,
    include_dead: bool,
    skip_blocking: bool,
    reason: str | None,
    by: str | None,
    heads_idle_for: str | None,
    chunk_size: int,
    dry_run: bool,
    as_json: bool,
    **cli_values: Any,
) -> None:
    """Delete finished rows older than --older-than in small batches (dead rows are kept
    unless --include-dead, dead ordered ones always unless --skip-blocking skips them);
    prints what it removed."""
    if older_than is None:
        raise ConfigError("relay prune needs --older-than DURATION (for example 7d): rows finished before then go")
    age = parse_duration(older_than, name="--older-than")  # 0 is allowed: every done row goes
    idle = None if heads_idle_for is None else parse_duration(heads_idle_for, name="--heads-idle-for")
    if idle is not None and idle < MIN_HEADS_IDLE:
        # A counter forgotten while a consumer still remembers the aggregate's last number
        # makes that consumer drop the restarted sequence as duplicates.
        raise ConfigError(f"invalid --heads-idle-for {shown(heads_idle_for)}: at least 1h")
    check_text(reason, "--reason")
    check_text(by, "--by")
    if reason is not None and not skip_blocking:
        raise ConfigError("--reason is recorded by --skip-blocking: give both, or neither")
    how = None
    if skip_blocking:
        how = SkipBlocking(by=by or default_operator(), reason=reason or "", skip=deadletters.skip)
    dsn, names = ops_setup(cli_values)

    async def body(conn: Conn) -> str:
        result = await prune(
            conn,
            names,
            age,
            include_dead=include_dead,
            skip_blocking=how,
            heads_idle_for=idle,
            batch=chunk_size,
            dry_run=dry_run,
        )
        if as_json:
            return json.dumps({**jsonable(result), "older_than": age.total_seconds(), "deleted": result.deleted})
        return render_prune(result, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@click.command("release")
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
        raise click.UsageError("say whose leases to release: --owner OWNER or --ids 1,2,3 (`relay status` counts them)")
    values = settings_for(RELEASE_OPTIONS, cli_values)
    configure_logging(values)
    dsn, names = require_dsn(values), names_from(values)
    who = by or default_operator()

    async def body(conn: Conn) -> str:
        result = await release(
            conn, names, owner=owner, ids=ids, by=who, note=reason,
            max_attempts=values["max_attempts"], dry_run=not yes,
        )  # fmt: skip
        return json.dumps(jsonable(result), indent=2) if as_json else render_release(result, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))
