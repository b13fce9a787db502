"""`relay replay`: publish finished messages again, in order per aggregate, changing nothing
in the outbox (the engine is :mod:`relay.replay`).

Exit codes: 0 every selected message was confirmed; 1 some could not be replayed (each is
named, with a resume command); 2 bad input, an empty selection or a database that cannot
be reached; 130 interrupted (with a resume command).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

import click

from relay import logs
from relay.cli.common import check_text, run, with_options
from relay.compose import REPLAY_OPTIONS
from relay.contract import DestinationCheck
from relay.db.replay import PlanSummary
from relay.dsn import mask
from relay.durations import format_duration, parse_moment
from relay.errors import ConfigError, shown
from relay.ids import parse_id_list, parse_outbox_id
from relay.operator_options import REPLAY_RUN_OPTIONS
from relay.replay import (
    MAX_EXCLUDED,
    MAX_ID,
    ReplayReport,
    Selection,
    count_of,
    summary_line,
)
from relay.replay_run import Replay, left_out_line

log = logging.getLogger("relay.replay")

# Without a terminal, one log line per this many messages settled.
LOG_EVERY = 10_000
MAX_RATE = 1_000_000.0
_RATE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,6})?")  # ASCII digits, as every number the relay reads
EXIT_INTERRUPTED = 130
EXIT_BAD_INPUT = 2  # a dry run that found a destination missing


@click.command("replay")
@with_options((*REPLAY_RUN_OPTIONS, *REPLAY_OPTIONS))
def replay_cmd(
    from_id: str | None,
    to_id: str | None,
    since: str | None,
    until: str | None,
    aggregates: tuple[str, ...],
    event_types: tuple[str, ...],
    include_dead: bool | None,
    include_skipped: bool | None,
    exclude_lists: tuple[str, ...],
    skip_failed: bool | None,
    to_destination: str | None,
    rate: str | None,
    run_id: str | None,
    dry_run: bool | None,
    **cli_values: Any,
) -> None:
    """Publish finished messages again (to a new consumer, or after a consumer lost them),
    in order per aggregate, without changing them: live relays keep running meanwhile.

    \b
    Select with --from-id/--to-id, --since/--until, --aggregate, --event-type (at least
    one). Every message carries what it carried live, plus the header `replay` = the run id.
    Ctrl-C stops cleanly and prints the command that does the rest.
    """
    now = datetime.now(UTC)
    for value, what in ((to_destination, "--to"), *((a, "--aggregate") for a in aggregates)):
        check_text(value, what)
    for value in event_types:
        check_text(value, "--event-type")
    selection = Selection(
        from_id=None if from_id is None else parse_outbox_id(from_id, "--from-id"),
        to_id=None if to_id is None else parse_outbox_id(to_id, "--to-id"),
        since=parse_moment(since, "--since", now),
        until=parse_moment(until, "--until", now),
        aggregates=aggregates,
        event_types=tuple(t.strip() for t in event_types),
        include_dead=bool(include_dead),
        include_skipped=bool(include_skipped),
        excluded=tuple(parse_id_list(exclude_lists, "--exclude", MAX_EXCLUDED)),
    ).check()
    per_second = _rate(rate)
    config_path = cli_values.pop("config_path", None)
    replay = Replay(
        selection,
        run_id=run_id,
        to=to_destination,
        rate=per_second,
        skip_failed=bool(skip_failed),
        environ=os.environ,
        config=config_path,
        **cli_values,
    )
    logs.configure(replay.parts.log.level, replay.parts.log.format)  # its warnings are logged when it starts
    resume = _Resume(selection, replay.run_id, rate, to_destination, bool(skip_failed))

    async def run_replay() -> int:
        async with replay:
            summary = replay.summary
            if dry_run:
                _print_dry_run(summary, replay.where, replay.run_id)
                checks = await replay.check_destinations()
                for line in _check_lines(checks):
                    click.echo(line)
                return EXIT_BAD_INPUT if _absent(checks) else 0
            await replay.require_destinations()
            click.echo(f"replay {replay.run_id}: {summary_line(summary)}, to {replay.where}", err=True)
            left_out = left_out_line(summary)
            if left_out:
                click.echo(f"replay {replay.run_id}: {left_out}", err=True)
            stop = asyncio.Event()
            _on_interrupt(stop)
            progress = _Progress(sys.stderr, summary.count)
            report = await replay.run(stop, progress=progress)
        progress.close()
        return _finish(report, resume, summary)

    code = run(run_replay)
    if code:
        sys.exit(code)


def _rate(text: str | None) -> float | None:
    """``--rate`` as messages per second: ``500``, ``500/s`` or ``3000/m``."""
    if text is None:
        return None
    number, _, unit = text.strip().lower().partition("/")
    per = {"": 1.0, "s": 1.0, "m": 60.0}.get(unit.strip())
    digits = number.strip()
    if per is None or not _RATE.fullmatch(digits) or not 0 < float(digits) / per <= MAX_RATE:
        raise ConfigError(
            f"invalid --rate {shown(text)}: expected messages per second or minute, such as 500/s or 3000/m"
            f" (at most {MAX_RATE:,.0f}/s)"
        )
    return float(digits) / per


def _print_dry_run(summary: PlanSummary, where: str, run_id: str) -> None:
    click.echo(f"would replay {summary_line(summary)}")
    if summary.left_out.total:
        click.echo(left_out_line(summary))
    click.echo(f"to {where}, with header replay={run_id}")
    click.echo("dry run: nothing was published")


def _absent(checks: Sequence[DestinationCheck] | None) -> list[DestinationCheck]:
    return [c for c in checks or () if c.known_absent]


def _check_lines(checks: Sequence[DestinationCheck] | None) -> list[str]:
    """What the dry run found of the destinations, a line each."""
    if checks is None:
        return ["destination: not checked (this broker has no destination to look at)"]
    lines = [f"destination: {c.describe()}" for c in checks]
    if _absent(checks):
        lines.append("a replay now would wait for the destinations that are not there: create them first")
    return lines


class _Resume:
    """How to do the rest of a replay: the command line it was given, with --from-id moved
    on, times made absolute (a duration counts from now, which moves) and passwords masked."""

    def __init__(
        self, selection: Selection, run_id: str, rate: str | None, to_destination: str | None, skip_failed: bool
    ) -> None:
        self.selection = selection
        self.run_id = run_id
        self.rate = rate
        self.to_destination = to_destination
        self.skip_failed = skip_failed

    def command(self, from_id: int, *, exclude: Iterable[int] = (), skip_failed: bool = False) -> tuple[str, bool]:
        """The command, and whether a password in it was masked; ``exclude`` adds ids to
        leave out, ``skip_failed`` asks for --skip-failed."""
        s = self.selection
        args = ["relay", "replay", "--from-id", str(from_id)]
        if s.to_id is not None and s.to_id != MAX_ID:
            args += ["--to-id", str(s.to_id)]
        if s.since:
            args += ["--since", s.since.isoformat()]
        if s.until:
            args += ["--until", s.until.isoformat()]
        for aggregate in s.aggregates:
            args += ["--aggregate", aggregate]
        for event_type in s.event_types:
            args += ["--event-type", event_type]
        if s.include_dead:
            args.append("--include-dead")
        if s.include_skipped:
            args.append("--include-skipped")
        excluded = sorted({*s.excluded, *exclude})
        if excluded:
            args += ["--exclude", ",".join(str(i) for i in excluded)]
        if self.skip_failed or skip_failed:
            args.append("--skip-failed")
        if self.to_destination is not None:
            args += ["--to", self.to_destination]
        if self.rate is not None:
            args += ["--rate", self.rate]
        args += ["--run-id", self.run_id, *_given_options()]
        text = shlex.join(args)
        shown_text = mask(text)
        return shown_text, shown_text != text


def _given_options() -> list[str]:
    """The options of `relay start` that this command line gave (the environment and the
    config file give theirs again by themselves)."""
    ctx = click.get_current_context()
    given: list[str] = []
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name not in _OPTION_DESTS:
            continue
        if ctx.get_parameter_source(param.name) != click.core.ParameterSource.COMMANDLINE:
            continue
        value = ctx.params.get(param.name)
        flag = param.opts[0]
        if param.is_flag or isinstance(value, bool):
            given.append(flag if value else (param.secondary_opts or [flag])[0])
        elif param.multiple:
            for v in value or ():
                given += [flag, str(v)]
        elif value is not None:
            given += [flag, str(value)]
    return given


_OPTION_DESTS = frozenset({*(o.dest for o in REPLAY_OPTIONS), "config_path"})


# A resume command names the ids that failed in --exclude up to this many; past it, it
# asks for --skip-failed instead (a command line stays one line a person can read).
EXCLUDE_IN_RESUME = 20


def _finish(report: ReplayReport, resume: _Resume, summary: PlanSummary) -> int:
    rate = report.published / report.elapsed_s if report.elapsed_s > 0 else 0.0
    took = format_duration_s(report.elapsed_s)
    click.echo(
        f"replay {report.run_id}: {report.published:,} of {count_of(report.total, 'message')} published in {took}"
        f" ({rate:,.0f} msg/s); the outbox was not changed"
    )
    if summary.left_out.total:
        click.echo(left_out_line(summary))
    if report.gone:
        click.echo(f"{count_of(report.gone, 'selected message')} pruned, re-driven or skipped meanwhile, not replayed")
    failed_ids = [i for i, _ in report.failed]
    if report.failed:
        first_id, first_reason = report.failed[0]
        held = ""
        if report.held_back:
            verb = "was" if report.held_back == 1 else "were"
            held = f"; {count_of(report.held_back, 'message')} after them in their aggregates {verb} held back"
        left = " and were left out (--skip-failed)" if report.failed_left_out else ""
        click.echo(
            f"{count_of(len(report.failed), 'message')} could not be replayed{left}"
            f" (first: id {first_id}: {first_reason}){held}"
        )
        shown_ids = ", ".join(str(i) for i in failed_ids[:20])
        more = f" and {len(report.failed) - 20:,} more" if len(report.failed) > 20 else ""
        click.echo(f"not replayed: {shown_ids}{more}")
        if report.no_room_for_marker:
            click.echo(
                f"{len(report.no_room_for_marker):,} of them fit the broker live but not with"
                " the replay marker the replay adds: a replay cannot send them (not without the marker, or"
                " consumers and FIFO de-duplication would take them for the live delivery); leave them out"
            )
    if report.lost_database:
        click.echo(f"the database connection was lost, the replay stopped: {report.lost_database}")
    if report.resume_from is not None:
        if report.interrupted:
            why = "interrupted"
        elif report.failed and len(report.permanent) == len(report.failed):
            # Refused for what they are: the same run would stop at them again.
            why = "they fail whatever is retried, so a run that includes them stops there again"
        else:
            why = "to replay the rest once the cause is fixed"
        command, masked = resume.command(report.resume_from)
        note = " (passwords are shown as ***: put them back, or set them in RELAY_* variables)" if masked else ""
        click.echo(f"{why}; the rest (from id {report.resume_from}) is replayed by{note}:")
        click.echo(f"  {command}")
        if report.failed and not report.failed_left_out:
            # A message that can never be replayed as it is (too large for the destination,
            # say) would stop its aggregate at every resume: this one goes on without it.
            if len(failed_ids) <= EXCLUDE_IN_RESUME:
                without, _ = resume.command(report.resume_from, exclude=failed_ids)
            else:
                without, _ = resume.command(report.resume_from, skip_failed=True)
            click.echo("or, to leave the messages that failed out and replay the rest of their aggregates:")
            click.echo(f"  {without}")
    if report.interrupted:
        return EXIT_INTERRUPTED
    return 0 if report.complete else 1


def format_duration_s(seconds: float) -> str:
    return format_duration(timedelta(seconds=seconds))


def _on_interrupt(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM stop the replay after the batches being published; a second one
    exits at once (nothing in the outbox depends on the replay, so nothing is lost)."""
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            os._exit(EXIT_INTERRUPTED)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


class _Progress:
    """A progress bar with rate and ETA on a terminal; otherwise one log line per
    :data:`LOG_EVERY` messages settled."""

    WIDTH = 30
    REDRAW_S = 0.2

    def __init__(self, stream: TextIO, total: int) -> None:
        self.stream = stream
        self.total = total
        self.tty = stream.isatty()
        self._drawn = 0.0
        self._logged = 0

    def __call__(self, report: ReplayReport) -> None:
        done = report.settled
        rate = report.published / report.elapsed_s if report.elapsed_s > 0 else 0.0
        left = max(self.total - done, 0)
        eta = format_duration_s(left / rate) if rate > 0 and left else "-"
        if self.tty:
            now = time.monotonic()
            if now - self._drawn < self.REDRAW_S and done < self.total:
                return
            self._drawn = now
            filled = self.WIDTH * done // max(self.total, 1)
            bar = "#" * filled + "." * (self.WIDTH - filled)
            self.stream.write(f"\r[{bar}] {done:,}/{self.total:,} {rate:,.0f} msg/s ETA {eta}   ")
            self.stream.flush()
        elif done // LOG_EVERY > self._logged // LOG_EVERY or (done == self.total and done > self._logged):
            self._logged = done
            log.info(
                "replay %s: %s of %s settled (%s published, %s not replayed), %s msg/s, ETA %s",
                report.run_id,
                f"{done:,}",
                f"{self.total:,}",
                f"{report.published:,}",
                f"{len(report.failed) + report.held_back:,}",
                f"{rate:,.0f}",
                eta,
            )

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
