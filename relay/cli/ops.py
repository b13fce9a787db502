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

from relay.claimcheck import StoredPayloads
from relay.cli.common import (
    BROKER_OPTIONS,
    OPS_OPTIONS,
    check_text,
    configure_logging,
    masked_first_line,
    ops_target,
    run,
    settings_for,
    settings_of_each,
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
from relay.operator_options import JSON, PRUNE_OPTIONS, RELEASE_OWN_OPTIONS, STATUS_OPTIONS
from relay.ops import deadletters
from relay.ops.deadletters import default_operator
from relay.ops.explain import explain
from relay.ops.release import parse_ids, release
from relay.ops.render import jsonable, render_explanation, render_prune, render_release, render_status, to_json
from relay.ops.status import read_status
from relay.options import load_file, resolve
from relay.retention import SkipBlocking, prune
from relay.routes import ROUTES_OPTION, destination_namer

# A release judges spent attempts as the relays' reaper does: by their --max-attempts
# (same flag, variable and config key, so `--config relay.toml` gives the fleet's value).
RELEASE_OPTIONS = (*OPS_OPTIONS, *(o for o in START_OPTIONS if o.dest == "max_attempts"))
RELEASE_ALL = (*RELEASE_OPTIONS, *RELEASE_OWN_OPTIONS)
STATUS_ALL = (*OPS_OPTIONS, *STATUS_OPTIONS)
EXPLAIN_ALL = (*OPS_OPTIONS, JSON)
# Where relay prune deletes the claim-check's objects of rows that left history: the store
# relay start wrote them to (the bucket is in each object's reference).
STORE_OPTIONS = tuple(o for o in START_OPTIONS if o.dest in ("claim_check_endpoint_url", "claim_check_region"))
PRUNE_ALL = (*OPS_OPTIONS, *PRUNE_OPTIONS, *STORE_OPTIONS)
CLEAR_SCREEN = "\x1b[H\x1b[2J"  # cursor home, erase the screen: --watch redraws in place


@click.command("status")
@with_options(STATUS_ALL)
def status_cmd(**cli_values: Any) -> None:
    """Is the relay keeping up? Counts, oldest waiting message, expired leases, attempts,
    blocked ordered aggregates (reads only unfinished rows; done is an estimate)."""
    config_path = cli_values.get("config_path")
    each = settings_of_each(STATUS_ALL, cli_values)
    if each is not None:
        _status_of_each(each, config_path)
        return
    values = settings_for(STATUS_ALL, cli_values)
    by_event_type: bool = values["status_by_event_type"]
    as_json: bool = values["json"]
    destination_of = _destinations(config_path) if by_event_type else None
    dsn, names = ops_target(values)
    where = describe_dsn(dsn)

    async def frame(conn: Conn) -> str:
        status = await read_status(conn, names, by_event_type=by_event_type, destination_of=destination_of)
        return json.dumps(to_json(status)) if as_json else render_status(status, names, where)

    if not values["status_watch"]:
        click.echo(run(lambda: with_conn(dsn, names, frame)))
        return
    period: timedelta = values["status_interval"]
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends: exit 0
        run(lambda: _watch(dsn, names, frame, period, as_json))


def _status_of_each(chosen: list[tuple[str, dict[str, Any]]], path: str | None) -> None:
    """`relay status` with a config file listing several outboxes and no --outbox: each
    outbox's status under its name, in the file's order; one that cannot be read says why
    (and the command exits 1 once all are shown)."""
    first = chosen[0][1]
    configure_logging(first)
    if first["status_by_event_type"]:
        raise ConfigError("--by-event-type reads one outbox's routes: add --outbox NAME")
    as_json: bool = first["json"]

    async def each() -> tuple[str, bool]:
        found = await asyncio.gather(*(_one_status(name, values, as_json) for name, values in chosen))
        if as_json:
            return json.dumps({"outboxes": [part for part, _ in found]}), all(ok for _, ok in found)
        return "\n\n".join(str(part) for part, _ in found), all(ok for _, ok in found)

    if not first["status_watch"]:
        text, ok = run(each)
        click.echo(text)
        if not ok:
            raise SystemExit(1)
        return
    period: timedelta = first["status_interval"]
    in_place = sys.stdout.isatty() and not as_json
    footer = f"\n\n{len(chosen)} outboxes of {path}; refreshing every {format_duration(period)}; Ctrl-C to stop"

    async def watch() -> None:
        while True:
            text, _ = await each()
            click.echo(CLEAR_SCREEN + text + footer if in_place else text + ("" if as_json else "\n"), nl=not in_place)
            sys.stdout.flush()
            await asyncio.sleep(period.total_seconds())

    with contextlib.suppress(KeyboardInterrupt):
        run(watch)


async def _one_status(name: str, values: dict[str, Any], as_json: bool) -> tuple[Any, bool]:
    """One outbox's part of a status of several: its text (or JSON object), and whether it
    could be read. Errors are this outbox's alone (one line, masked)."""
    try:
        dsn, names = require_dsn(values), names_from(values)
        status = await with_conn(dsn, names, lambda conn: read_status(conn, names))
    except (ConfigError, DatabaseUnavailable, psycopg.Error) as exc:
        error = masked_first_line(exc)
        return ({"outbox": name, "error": error} if as_json else f"== outbox {name}\nerror: {error}"), False
    if as_json:
        return {"outbox": name, **to_json(status)}, True
    return f"== outbox {name}\n" + render_status(status, names, describe_dsn(dsn)), True


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
@with_options(EXPLAIN_ALL)
@click.argument("aggregate_id")
def explain_cmd(aggregate_id: str, **cli_values: Any) -> None:
    """Why AGGREGATE_ID's ordered messages are or are not moving: its head message, status,
    attempts, last error, next eligible time, lease, and how many wait behind it."""
    values = settings_for(EXPLAIN_ALL, cli_values)
    check_text(aggregate_id, "AGGREGATE_ID")
    dsn, names = ops_target(values)
    as_json: bool = values["json"]

    async def body(conn: Conn) -> str:
        e = await explain(conn, names, aggregate_id)
        return json.dumps(jsonable(e), indent=2) if as_json else render_explanation(e, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


MIN_HEADS_IDLE = timedelta(hours=1)  # the error below says 1h


@click.command("prune")
@with_options(PRUNE_ALL)
def prune_cmd(**cli_values: Any) -> None:
    """Delete finished rows older than --older-than in small batches (dead rows are kept
    unless --include-dead, dead ordered ones always unless --skip-blocking skips them);
    prints what it removed."""
    values = settings_for(PRUNE_ALL, cli_values)
    age: timedelta | None = values["prune_cutoff"]  # 0 is allowed: every done row goes
    heads_idle_for: str | None = values["prune_heads_cutoff"]
    reason: str | None = values["reason"]
    by: str | None = values["by"]
    skip_blocking: bool = values["prune_skip_blocking"]
    if age is None:
        raise ConfigError("relay prune needs --older-than DURATION (for example 7d): rows finished before then go")
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
    dsn, names = ops_target(values)

    async def body(conn: Conn) -> str:
        result = await prune(
            conn,
            names,
            age,
            include_dead=values["prune_include_dead"],
            skip_blocking=how,
            heads_idle_for=idle,
            batch=values["prune_chunk_size"],
            dry_run=values["dry_run"],
            payloads=StoredPayloads(values.get("claim_check_endpoint_url"), values.get("claim_check_region")),
        )
        if values["json"]:
            return json.dumps({**jsonable(result), "older_than": age.total_seconds(), "deleted": result.deleted})
        return render_prune(result, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))


@click.command("release")
@with_options(RELEASE_ALL)
def release_cmd(**cli_values: Any) -> None:
    """Hand back the leases of a worker that is gone (a crashed host), before they expire:
    its processing rows go back to pending (dead if their attempts are spent, as when a
    lease expires), lease_version + 1 so its late finalize writes nothing. Without --yes,
    only shows what it would release."""
    values = settings_for(RELEASE_ALL, cli_values)
    owner: str | None = values["release_owner"]
    if owner is not None and not owner.strip():
        raise ConfigError("invalid --owner: must not be empty")
    ids = parse_ids(values["release_ids"])
    if owner is None and not ids:
        raise click.UsageError("say whose leases to release: --owner OWNER or --ids 1,2,3 (`relay status` counts them)")
    dsn, names = ops_target(values)
    by: str | None = values["by"]
    reason: str | None = values["reason"]
    as_json: bool = values["json"]
    who = by or default_operator()

    async def body(conn: Conn) -> str:
        result = await release(
            conn, names, owner=owner, ids=ids, by=who, note=reason,
            max_attempts=values["max_attempts"], dry_run=not values["release_yes"],
        )  # fmt: skip
        return json.dumps(jsonable(result), indent=2) if as_json else render_release(result, names)

    click.echo(run(lambda: with_conn(dsn, names, body)))
