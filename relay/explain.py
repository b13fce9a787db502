"""`relay explain AGGREGATE_ID`: why an aggregate's ordered messages are or are not moving.

An ordered aggregate moves one message at a time: its head (named by ``<table>_heads``)
is claimed, published and finished, then the one with the next ``aggregate_seq`` becomes
the head. So "why is it stuck" is always a question about the head: dead (an operator must
act), leased (in flight, or its worker died and the lease has to run out), backing off
after a failure, ready and waiting for a worker, or committed but not numbered by a relay
yet. Unordered messages of the aggregate are reported beside it; they neither wait for the
head nor hold it up.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from psycopg.rows import dict_row

from relay.dsn import mask
from relay.errors import ConfigError, shown
from relay.sqlnames import OutboxNames
from relay.status import Conn, age_text, ops_query
from relay.textsafe import CELL_CHARS, clip, escape, printable

State = Literal["blocked", "in_flight", "lease_expired", "backing_off", "ready", "awaiting_ingest", "idle"]


@dataclass(frozen=True)
class HeadMessage:
    """The message at the head of the aggregate's ordered sequence."""

    id: int
    event_type: str
    status: str
    attempts: int
    last_error: str | None
    available_at: datetime
    lease_owner: str | None
    lease_until: datetime | None
    lease_version: int
    created_at: datetime
    aggregate_seq: int | None
    resolution: str | None  # the last operator action on it ('retried'), if any
    resolved_by: str | None
    resolved_at: datetime | None


@dataclass(frozen=True)
class Explanation:
    """Where an aggregate stands and why, by the database clock ``at``."""

    aggregate_id: str
    at: datetime
    state: State
    reason: str  # one sentence a person can act on
    head: HeadMessage | None
    next_eligible_at: datetime | None  # when the head may be claimed next; None: not by itself
    waiting_behind: int  # numbered ordered messages queued behind the head
    not_numbered: int  # ordered messages committed but not numbered by an ingest yet
    last_seq: int  # the last aggregate_seq handed out in this aggregate (0: none yet)
    unordered_pending: int
    unordered_processing: int
    unordered_dead: int
    hints: tuple[str, ...]  # commands or checks that move it on


async def explain(conn: Conn, names: OutboxNames, aggregate_id: str) -> Explanation:
    """Read the aggregate's head and the counts around it; ConfigError when nothing is known of it."""
    params = {"aggregate_id": aggregate_id}
    cur = conn.cursor(row_factory=dict_row)
    await cur.execute(ops_query(names, "explain_head"), params)
    h = await cur.fetchone()
    await cur.execute(ops_query(names, "explain_ordered"), params)
    o = await cur.fetchone()
    await cur.execute(ops_query(names, "explain_unordered"), params)
    u = await cur.fetchone()
    if h is None or o is None or u is None:  # single-row SELECTs without FROM filters
        raise RuntimeError("explain queries returned no row")
    now: datetime = h["now"]
    head = _head(h) if h["id"] is not None else None
    unordered = (u["pending"], u["processing"], u["dead"])
    if not h["has_heads_row"] and o["n"] == 0 and not o["not_numbered"] and not any(unordered):
        raise ConfigError(
            f"aggregate {shown(aggregate_id)} not found in {names.qualified}: no unfinished messages and no ordered"
            " history (an aggregate id is matched exactly)"
        )
    waiting_behind = o["n"] - 1 if head is not None else 0
    not_numbered = o["not_numbered"]
    state, reason, next_at, hints = _diagnose(names, now, head, waiting_behind, not_numbered)
    return Explanation(
        aggregate_id=aggregate_id,
        at=now,
        state=state,
        reason=reason,
        head=head,
        next_eligible_at=next_at,
        waiting_behind=waiting_behind,
        not_numbered=not_numbered,
        last_seq=h["last_seq"] or 0,
        unordered_pending=unordered[0],
        unordered_processing=unordered[1],
        unordered_dead=unordered[2],
        hints=hints,
    )


def _head(r: dict[str, Any]) -> HeadMessage:
    return HeadMessage(
        id=r["id"],
        event_type=r["event_type"],
        status=r["status"],
        attempts=r["attempts"],
        # Rows written before last_error was masked on the way in are masked on the way out.
        last_error=mask(r["last_error"]) if r["last_error"] else r["last_error"],
        available_at=r["available_at"],
        lease_owner=r["lease_owner"],
        lease_until=r["lease_until"],
        lease_version=r["lease_version"],
        created_at=r["created_at"],
        aggregate_seq=r["aggregate_seq"],
        resolution=r["resolution"],
        resolved_by=r["resolved_by"],
        resolved_at=r["resolved_at"],
    )


def _target(names: OutboxNames) -> str:
    """The ``--schema``/``--table`` flags a suggested command needs for this outbox."""
    flags = []
    if names.schema != "public":
        flags += ["--schema", names.schema]
    if names.table != "outbox":
        flags += ["--table", names.table]
    return (" " + shlex.join(flags)) if flags else ""


def _diagnose(
    names: OutboxNames,
    now: datetime,
    head: HeadMessage | None,
    behind: int,
    not_numbered: int,
) -> tuple[State, str, datetime | None, tuple[str, ...]]:
    if behind == 0:
        stuck, after = "nothing waits behind it yet, but every new ordered message of this aggregate will", ""
    else:
        queue = f"{behind:,} ordered message{'s' if behind != 1 else ''} behind it"
        stuck = f"the {queue} cannot move"
        after = f"; the {queue} follow{'s' if behind == 1 else ''} once it is finished"
    if head is None:
        if not_numbered == 0:
            return "idle", "nothing waits: every ordered message of this aggregate is finished", None, ()
        return (
            "awaiting_ingest",
            f"{not_numbered:,} committed ordered message(s) wait to be numbered; a running relay numbers them"
            " (and makes the first the head) on its next claim",
            None,
            ("check that a relay is running: relay status",),
        )
    if head.status == "dead":
        target = _target(names)
        return (
            "blocked",
            f"the head message #{head.id} is dead, so {stuck}",
            None,
            (
                f"relay dead retry {head.id}{target}    # deliver it again; the rest follow in order",
                f"relay dead skip {head.id} --reason TEXT{target}    # give up on it; the next message moves up",
            ),
        )
    if head.status == "processing":
        assert head.lease_until is not None  # the table's lease check: processing rows hold a lease
        if head.lease_until > now:
            return (
                "in_flight",
                f"the head message #{head.id} is being published by {escape(head.lease_owner or '?')} (lease_version"
                f" {head.lease_version}){after}",
                head.lease_until,
                (),
            )
        return (
            "lease_expired",
            f"the lease of {escape(head.lease_owner or '?')} on the head message #{head.id} expired"
            f" {age_text((now - head.lease_until).total_seconds())} ago (did that worker die?); the next claim of"
            " any running relay takes it over",
            head.lease_until,
            ("check that a relay is running: relay status",),
        )
    if head.available_at > now:
        return (
            "backing_off",
            f"the head message #{head.id} failed attempt {head.attempts} and waits"
            f" {age_text((head.available_at - now).total_seconds())} before the next one",
            head.available_at,
            (),
        )
    return (
        "ready",
        f"the head message #{head.id} is ready to be claimed (for"
        f" {age_text((now - head.available_at).total_seconds())}); it waits for a worker",
        head.available_at,
        ("if it stays ready, check that a relay is running and keeping up: relay status",),
    )


def render_text(e: Explanation, names: OutboxNames) -> str:
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
