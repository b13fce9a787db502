"""What the operator commands print: text for people and JSON-ready dicts, from the objects
of :mod:`relay.ops.status`, :mod:`relay.ops.explain`, :mod:`relay.ops.deadletters`,
:mod:`relay.retention` and :mod:`relay.ops.release`.

Nothing here reads the database. In the status, explain and dead output, producer data
(event types, aggregate ids, errors) is escaped and cut by :mod:`relay.textsafe`, so a
newline or an escape code in a row cannot forge a line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime, timedelta
from typing import Any

from relay.db.names import OutboxNames
from relay.db.partitions import bounds_text
from relay.db.readmodel import DeadFilter, DeadPage, WakeupStatus
from relay.durations import age_text, format_duration
from relay.ops.deadletters import DeadGroups, WriteResult
from relay.ops.explain import Explanation
from relay.ops.release import SHOWN, ReleaseResult
from relay.ops.status import EventTypeStatus, Status, attempt_histogram
from relay.retention import HeadsResult, PruneResult
from relay.textsafe import CELL_CHARS, clip, escape, printable

# ---- shared helpers


def jsonable(value: Any) -> Any:
    """``value`` with dataclasses as dicts and datetimes as ISO 8601 text, ready for json.dumps."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """``rows`` under ``header`` in columns two spaces apart; the columns ``right`` right-aligned."""
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        parts = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(parts).rstrip()

    return "\n".join([fmt(header), *(fmt(r) for r in rows)])


def bytes_text(n: int | None) -> str:
    """``n`` bytes in binary units (``3.0 MiB``), or ``unknown``."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def one_line(text: str | None, width: int) -> str:
    """``text`` escaped onto one line of at most ``width`` characters, or ``-``."""
    if not text:
        return "-"
    line = escape(" ".join(text.split()))
    return line if len(line) <= width else line[: width - 3] + "..."


def ids_text(items: Sequence[object], limit: int = 20) -> str:
    """The first ``limit`` of ``items``, comma-separated, and how many more."""
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit:,} more" if len(items) > limit else "")


# ---- relay status


def to_json(status: Status) -> dict[str, Any]:
    """A JSON-ready dict of ``status`` (ages in seconds, times ISO 8601)."""
    out: dict[str, Any] = jsonable(status)
    out["summary"]["pending"] = status.summary.pending
    out["summary"]["awaiting"] = status.summary.awaiting
    if status.by_event_type is None:
        del out["by_event_type"]
    out["settings"] = status.settings.to_json() if status.settings else None
    return out


def render_status(status: Status, names: OutboxNames, where: str) -> str:
    """The human view of ``status``; ``where`` names the database (never with a password)."""
    s = status.summary
    lines = [
        f"outbox {names.qualified} on {where}, at {s.at.isoformat(timespec='seconds')} (database clock)",
        "",
        f"  pending        {s.pending:>10,}   ordered {s.pending_ordered:,}, unordered {s.pending_unordered:,}",
        f"  processing     {s.processing:>10,}   expired leases {s.expired_leases:,}",
        f"  dead           {s.dead:>10,}   oldest {age_text(s.oldest_dead_age_s)}",
        "  done (est.)    "
        + (f"{'~' + format(s.done_estimate, ','):>10}" if s.done_estimate is not None else f"{'unknown':>10}")
        + "   estimate from table statistics, not a count",
        f"  table size     {bytes_text(s.total_bytes):>10}   with indexes",
        "",
        f"  oldest awaiting delivery  {age_text(s.oldest_waiting_age_s)}   (pending or processing)",
        f"  blocked aggregates        {s.blocked_aggregates:,}"
        + (
            f"   oldest dead head {age_text(s.oldest_blocked_age_s)}, {s.waiting_behind_blocked:,} messages wait"
            " behind them (`relay dead list`)"
            if s.blocked_aggregates
            else ""
        ),
        "",
        "  attempts used by messages awaiting delivery",
    ]
    histogram = attempt_histogram(status.attempts)
    widest = max((n for _, n in histogram), default=0)
    for label, n in histogram:
        bar = "#" * (round(30 * n / widest) if widest else 0)
        lines.append(f"    {label:>5}  {n:>10,}  {bar}".rstrip())
    if status.settings is not None:
        o = status.settings.ordering
        lines += [
            "",
            "  shared settings (`relay settings show`, changed by `relay settings set`)",
            f"    ordering  default {status.settings.value('ordering_default')}, ordered {list(o.ordered)},"
            f" unordered {list(o.unordered)}",
            f"    notify    {'true' if status.settings.notify else 'false (producers send no wake-ups; relays poll)'}",
        ]
    if status.wakeups is not None:
        lines.append(f"  wake-ups       {_wakeups_text(status.wakeups)}")
    if status.by_event_type is not None:
        lines += ["", event_type_table(status.by_event_type)]
    return "\n".join(lines)


def _wakeups_text(w: WakeupStatus) -> str:
    if not w.listening:
        return "no relay listening (relays that run poll, or none runs)"
    relays = f"{w.listening} relay process{'es' if w.listening != 1 else ''} listening, {w.idle} idle"
    if w.producers_notify:
        return f"{relays}: producers' inserts wake them"
    if w.idle < w.listening:
        return f"{relays}: producers send no wake-ups (a working relay claims new rows itself)"
    # All idle and still no wake-ups: the stored notify is off, or the answer in the settings
    # row lapsed (an idle relay killed, another not renewed yet; relays older than 0008).
    return f"{relays}: producers send no wake-ups (notify is off, or the relays' answer has lapsed)"


def event_type_table(rows: Sequence[EventTypeStatus]) -> str:
    if not rows:
        return "  no unfinished messages of any event type"
    # Event types are producer data: escaped, so a newline in one cannot start a row, and
    # cut, so one 70,000-character type does not widen the whole table.
    shown = [printable(r.event_type) for r in rows]
    width = max(10, *(len(t) for t in shown))
    routed = any(r.destination is not None for r in rows)
    ages = [age_text(r.oldest_waiting_age_s) for r in rows]
    age_width = max(14, *(len(a) for a in ages))
    head = f"  {'EVENT TYPE':<{width}}  {'PENDING':>9}  {'PROCESSING':>10}  {'EXPIRED':>7}  {'DEAD':>7}  "
    head += f"{'OLDEST WAITING':<{age_width}}  DESTINATION" if routed else "OLDEST WAITING"
    body = [
        f"  {t:<{width}}  {r.pending:>9,}  {r.processing:>10,}  {r.expired_leases:>7,}  {r.dead:>7,}  "
        + (f"{age:<{age_width}}  {printable(r.destination or '-')}" if routed else age)
        for t, r, age in zip(shown, rows, ages, strict=True)
    ]
    return "\n".join([line.rstrip() for line in (head, *body)])


# ---- relay explain


def render_explanation(e: Explanation, names: OutboxNames) -> str:
    """The human view of ``e``."""
    # Producer data (the id, event type, error) is escaped and cut; repr() escapes the id.
    shown_id = clip(e.aggregate_id, CELL_CHARS)
    lines = [f"aggregate {shown_id!r} in {names.qualified}: {e.state.upper().replace('_', ' ')}", f"  {e.reason}"]
    lines.append("")
    h = e.head
    if h is not None:
        seq = f"  aggregate_seq {h.aggregate_seq}" if h.aggregate_seq is not None else ""
        lines += [
            f"  head          #{h.id}  {printable(h.event_type)}{seq}",
            f"  status        {h.status}, {h.attempts} attempt{'s' if h.attempts != 1 else ''} used",
            f"  last error    {escape(h.last_error) if h.last_error else '-'}",
            f"  created       {h.created_at.isoformat(timespec='seconds')}"
            f" ({age_text((e.at - h.created_at).total_seconds())} ago)",
            f"  next eligible {_eligible(e)}",
            f"  lease         {_lease(e)}",
        ]
        if h.resolution:
            at = h.resolved_at.isoformat(timespec="seconds") if h.resolved_at else "?"
            lines.append(f"  operator      {h.resolution} by {escape(h.resolved_by or '?')} at {at}")
        lines.append(f"  behind it     {e.waiting_behind:,} ordered message{'s' if e.waiting_behind != 1 else ''}")
    else:
        lines.append("  head          none")
    if e.not_numbered or h is None:
        lines.append(f"  not numbered  {e.not_numbered:,} committed ordered message(s)")
    lines.append(f"  last number   {e.last_seq:,} (aggregate_seq handed out so far)")
    lines.append(
        f"  unordered     {e.unordered_pending:,} pending, {e.unordered_processing:,} processing,"
        f" {e.unordered_dead:,} dead (outside the ordered sequence: they neither wait nor block)"
    )
    if e.hints:
        lines += ["", "  next steps"] + [f"    {hint}" for hint in e.hints]
    return "\n".join(lines)


def _eligible(e: Explanation) -> str:
    h = e.head
    assert h is not None
    if h.status == "dead":
        return "never by itself: a dead message waits for an operator"
    if e.next_eligible_at is None:
        return "-"
    when = e.next_eligible_at.isoformat(timespec="seconds")
    delta = (e.next_eligible_at - e.at).total_seconds()
    if h.status == "processing":
        suffix = "when the lease expires, if the worker has not finished it by then"
        return f"{when} ({'in ' + age_text(delta) if delta > 0 else 'expired'}; {suffix})"
    return f"{when} ({'in ' + age_text(delta) if delta > 0 else 'now'})"


def _lease(e: Explanation) -> str:
    h = e.head
    assert h is not None
    if h.lease_until is None:
        return f"none (lease_version {h.lease_version})"
    until = h.lease_until.isoformat(timespec="seconds")
    return f"{escape(h.lease_owner or '?')} until {until} (lease_version {h.lease_version})"


# ---- relay dead


# Refused ids a refusal line names; the rest are counted (two operators re-driving one
# group of 5,000 at once made the loser print every id on one 150 kB line).
REFUSED_SHOWN = 20


def refusal_line(result: WriteResult) -> str:
    """One line naming the first refused ids and counting the rest, for the CLI's error exit."""
    reasons = "; ".join(f"{r.id}: {r.reason}" for r in result.refused[:REFUSED_SHOWN])
    more = len(result.refused) - REFUSED_SHOWN
    tail = f"; and {more:,} more ({len(result.refused):,} refused)" if more > 0 else ""
    return f"refused to {result.action} (nothing changed): {reasons}{tail}"


def render_write(result: WriteResult) -> str:
    """What a re-drive or skip did (or, in a dry run, would do), for people."""
    ids = [t.id for t in result.changed]
    aggregates = [printable(a) for a in sorted({t.aggregate_id for t in result.changed if t.ordered})]
    noun = f"{len(ids):,} dead message{'s' if len(ids) != 1 else ''}"
    if result.action == "retry":
        verb, detail, onward = "re-drove", "to pending (attempts reset, available now, in id order)", "resume in order"
    else:
        verb, detail, onward = "skipped", "(marked done without delivery)", "move on to their next message"
    verb = verb.capitalize()
    if result.dry_run:
        verb = "dry run: would " + ("re-drive" if result.action == "retry" else "skip")
    lines = [f"{verb} {noun} {detail}", f"  ids: {ids_text(ids)}", f"  by: {escape(result.by)}"]
    if result.note:
        lines.append(f"  reason: {escape(result.note)}")
    if aggregates:
        lines.append(f"  ordered aggregates that {'would ' if result.dry_run else ''}{onward}: {ids_text(aggregates)}")
    if result.dry_run:
        lines.append("  nothing changed")
    return "\n".join(lines)


def render_list(page: DeadPage, flt: DeadFilter) -> str:
    """`relay dead list` as a table, oldest id first."""
    if not page.messages:
        return "no dead messages" if flt.is_empty() else f"no dead messages match {flt.describe()}"
    at = page.at
    rows = [
        (
            str(m.id),
            printable(m.event_type),
            printable(m.aggregate_id),
            str(m.attempts),
            age_text((at - m.created_at).total_seconds()) if at else "?",
            "yes" if m.blocking else "",
            one_line(m.last_error, 80),
        )
        for m in page.messages
    ]
    header = ("ID", "EVENT TYPE", "AGGREGATE", "ATT", "AGE", "BLOCKS", "LAST ERROR")
    out = table(header, rows, right=(0, 3))
    if page.total > len(page.messages):
        out += f"\n{page.total - len(page.messages):,} more not shown (--limit)"
    blocking = sum(m.blocking for m in page.messages)
    if blocking:
        out += f"\n{blocking:,} of these block their ordered aggregate (BLOCKS): `relay explain AGGREGATE_ID`"
    return out


def render_groups(view: DeadGroups, flt: DeadFilter) -> str:
    """`relay dead list --group`: one line per error fingerprint, one page of groups."""
    if not view.groups:
        if view.total_groups:
            return f"no page {view.page}: {view.total_groups:,} groups fill {view.pages:,} pages"
        return "no dead messages" if flt.is_empty() else f"no dead messages match {flt.describe()}"
    rows = [
        (
            g.key,
            f"{g.count:,}",
            f"{g.blocking:,}",
            ", ".join(printable(t) for t in g.event_types[:3]) + (", ..." if len(g.event_types) > 3 else ""),
            f"{g.first_id}..{g.last_id}" if g.first_id != g.last_id else str(g.first_id),
            escape(g.fingerprint),
        )
        for g in view.groups
    ]
    header = ("GROUP", "COUNT", "BLOCKING", "EVENT TYPES", "IDS", "ERROR FINGERPRINT")
    out = table(header, rows, right=(1, 2)) + (
        f"\n{view.total:,} dead messages in {view.total_groups:,} groups;"
        " re-drive one with `relay dead retry --group GROUP`"
    )
    if view.pages > 1:
        out += f"\npage {view.page:,} of {view.pages:,} ({view.per_page} groups a page): --page N for another"
    return out


# ---- relay prune


def render_prune(result: PruneResult, names: OutboxNames) -> str:
    """One paragraph saying what was (or would be) removed, skipped and forgotten."""
    if result.partitions is not None:
        return _render_partitions_pruned(result, names)
    verb = "would delete" if result.dry_run else "deleted"
    lines = [
        f"{'dry run: ' if result.dry_run else ''}{names.qualified}: {verb} {result.done:,} done row"
        f"{'s' if result.done != 1 else ''} finished before {result.cutoff.isoformat(timespec='seconds')}"
        f" (older than {format_duration(result.older_than)})",
    ]
    if result.include_dead:
        lines.append(f"  and {result.dead:,} dead unordered row{'s' if result.dead != 1 else ''} created before it")
        lines += _blocking_lines(result)
    else:
        lines.append("  dead rows kept (--include-dead removes the unordered ones created before the cutoff)")
    lines.append(
        f"  {result.batches:,} batch{'es' if result.batches != 1 else ''}, {result.scanned:,} rows read"
        + (f", stopped after id {result.last_id}" if result.last_id is not None else "")
    )
    if result.heads is not None:
        lines.append(_heads_line(result.heads, result.dry_run))
    lines += _payloads_lines(result)
    if result.dry_run:
        lines.append("  nothing changed")
    return "\n".join(lines)


def _render_partitions_pruned(result: PruneResult, names: OutboxNames) -> str:
    """A partitioned outbox's prune: the partitions dropped, and each kept one with why."""
    p = result.partitions
    assert p is not None
    verb = "would drop" if result.dry_run else "dropped"
    n = len(p.dropped)
    lines = [
        f"{'dry run: ' if result.dry_run else ''}{names.qualified}: {verb} {n:,} partition{'s' if n != 1 else ''}"
        f" ({result.done:,} done row{'s' if result.done != 1 else ''}"
        + (f", {result.dead:,} dead unordered" if result.include_dead else "")
        + f") whose every row finished before {result.cutoff.isoformat(timespec='seconds')}"
        f" (older than {format_duration(result.older_than)})",
    ]
    if p.refused:
        lines.append(f"  nothing dropped: {p.refused}")
    for d in p.dropped:
        lines.append(f"  {d.name}: {verb} ({bounds_text(d.lo, d.hi)}, {d.done + d.dead:,} rows)")
    for k in p.kept:
        lines.append(f"  {k.name}: kept, {k.why}")
    if p.more_kept:
        lines.append(f"  and {p.more_kept:,} more partitions kept")
    if result.include_dead:
        lines += _blocking_lines(result)
    else:
        lines.append(
            "  a dead row keeps its partition (--include-dead lets the unordered ones created before the cutoff go)"
        )
    if result.heads is not None:
        lines.append(_heads_line(result.heads, result.dry_run))
    lines += _payloads_lines(result)
    if result.dry_run:
        lines.append("  nothing changed")
    return "\n".join(lines)


def _payloads_lines(result: PruneResult) -> list[str]:
    """What became of the claim-check's objects whose rows left history."""
    p = result.payloads
    if p is None:
        return []
    lines = []
    if p.deleted:
        verb = "would delete" if result.dry_run else "deleted"
        lines.append(f"  {verb} {p.deleted:,} stored payload{'s' if p.deleted != 1 else ''} of rows that left history")
    if p.waiting:
        lines.append(
            f"  {p.waiting:,} or more stored payloads of rows that left history were not deleted (the next prune"
            f" tries again): {printable(p.why or 'no reason given', 300)}"
        )
    return lines


def _blocking_lines(result: PruneResult) -> list[str]:
    """What became of the dead ordered rows before the cutoff, with their aggregates named."""
    b = result.blocking
    if b is None or not b.n:
        return []
    shown_ids = ", ".join(printable(a, 80) for a in b.sample)
    more = b.aggregates - len(b.sample)
    aggregates = f"{b.aggregates:,} aggregate{'s' if b.aggregates != 1 else ''}: {shown_ids}" + (
        f" and {more:,} more" if more > 0 else ""
    )
    noun = f"dead ordered message{'s' if b.n != 1 else ''}"
    if not result.skipped:
        return [
            f"  kept {b.n:,} {noun} created before it: each stops its aggregate, and deleting it would"
            f" unblock the aggregate and leave a hole in aggregate_seq ({aggregates})",
            "  skip them, recorded, with --skip-blocking --reason TEXT (or relay dead skip / relay dead retry)",
        ]
    verb = "would skip" if result.dry_run else "skipped"
    unblocked = "would unblock" if result.dry_run else "unblocked"
    lines = [
        f"  {verb} {result.skipped:,} {noun} created before it, recorded as relay dead skip records them;"
        f" {unblocked} {aggregates}",
    ]
    if result.skipped != b.n:
        lines.append(f"  ({b.n - result.skipped:,} of them changed meanwhile, re-driven or skipped: left alone)")
    return lines


def _heads_line(h: HeadsResult, dry_run: bool) -> str:
    if h.postponed:
        return (
            f"  heads: none forgotten: {h.waiting:,} or more ordered rows wait to be numbered (relays stopped or"
            " behind); a later prune forgets idle aggregates once they have caught up"
        )
    verb = "would forget" if dry_run else "forgot"
    return (
        f"  heads: {verb} the aggregate_seq counters of {h.forgotten:,} ordered aggregate"
        f"{'s' if h.forgotten != 1 else ''} idle for {format_duration(h.idle_for)} (nothing unfinished, nothing"
        f" numbered since {h.cutoff.isoformat(timespec='seconds')}; each starts again at aggregate_seq 1 if it comes"
        f" back), {h.scanned:,} heads rows read"
    )


# ---- relay release


def render_release(result: ReleaseResult, names: OutboxNames) -> str:
    """What a release did (or would do), for people."""
    n = len(result.released)
    noun = f"{n:,} leased message{'s' if n != 1 else ''} of {names.qualified}"
    whose = f" held by {printable(result.owner)}" if result.owner else ""
    if result.dry_run:
        lines = [f"dry run: would release {noun}{whose}"]
    else:
        lines = [f"Released {noun}{whose} (lease_version + 1: the old owner's late finalize writes nothing)"]
    at = result.at
    rows = [
        (
            str(h.id),
            # Producer data and the owner a worker wrote: escaped and cut, as in the other
            # commands' tables, so a hostile value cannot forge lines or steer the terminal.
            printable(h.aggregate_id),
            printable(h.event_type),
            printable(h.lease_owner),
            str(h.lease_version),
            _lease_text(h.lease_until, at),
            str(h.attempts),
            h.then if h.then == "pending" else f"dead (attempts spent, max {result.max_attempts})",
        )
        for h in result.released[:SHOWN]
    ]
    header = ("ID", "AGGREGATE", "EVENT TYPE", "OWNER", "LEASE_VERSION", "LEASE EXPIRES", "ATT", "THEN")
    lines += ["  " + line for line in table(header, rows, right=(0, 4, 6)).splitlines()]
    if n > SHOWN:
        lines.append(f"  ... and {n - SHOWN:,} more (--json lists all)")
    aggregates = sorted({h.aggregate_id for h in result.released if h.ordered and h.then == "pending"})
    if aggregates:
        shown = ", ".join(printable(a) for a in aggregates[:20])
        shown += f" and {len(aggregates) - 20:,} more" if len(aggregates) > 20 else ""
        lines.append(f"  ordered aggregates that {'would ' if result.dry_run else ''}resume in order: {shown}")
    if result.refused:
        lines.append("  not touched:")
        lines += [f"    {r.id}: {r.reason}" for r in result.refused[:SHOWN]]
        if len(result.refused) > SHOWN:
            lines.append(f"    ... and {len(result.refused) - SHOWN:,} more")
    lines.append(f"  by: {escape(result.by)}")
    if result.dry_run:
        lines += [
            "  nothing changed; run again with --yes to release them (only for a worker that is gone:",
            "  a live worker's finalize is then refused and its messages are delivered again)",
        ]
    return "\n".join(lines)


def _lease_text(until: datetime, at: datetime | None) -> str:
    stamp = until.isoformat(timespec="seconds")
    if at is None:
        return stamp
    left = (until - at).total_seconds()
    return f"{stamp} ({'in ' + age_text(left) if left > 0 else 'expired ' + age_text(-left) + ' ago'})"
