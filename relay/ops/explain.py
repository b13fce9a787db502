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
from typing import Literal

from relay.db import readmodel
from relay.db.names import OutboxNames
from relay.db.readmodel import AggregateRows, Conn, HeadMessage
from relay.durations import age_text
from relay.errors import ConfigError, shown
from relay.textsafe import escape

State = Literal["blocked", "in_flight", "lease_expired", "backing_off", "ready", "awaiting_ingest", "idle"]


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
    return explanation(names, aggregate_id, await readmodel.aggregate_rows(conn, names, aggregate_id))


def explanation(names: OutboxNames, aggregate_id: str, rows: AggregateRows) -> Explanation:
    """Where the aggregate of ``rows`` stands and why; ConfigError when nothing is known of it."""
    head = rows.head
    unordered = (rows.unordered_pending, rows.unordered_processing, rows.unordered_dead)
    if not rows.has_heads_row and rows.ordered == 0 and not rows.not_numbered and not any(unordered):
        raise ConfigError(
            f"aggregate {shown(aggregate_id)} not found in {names.qualified}: no unfinished messages and no ordered"
            " history (an aggregate id is matched exactly; prune --heads-idle-for forgets idle aggregates)"
        )
    waiting_behind = rows.ordered - 1 if head is not None else 0
    not_numbered = rows.not_numbered
    state, reason, next_at, hints = _diagnose(names, rows.now, head, waiting_behind, not_numbered, rows.last_seq or 0)
    return Explanation(
        aggregate_id=aggregate_id,
        at=rows.now,
        state=state,
        reason=reason,
        head=head,
        next_eligible_at=next_at,
        waiting_behind=waiting_behind,
        not_numbered=not_numbered,
        last_seq=rows.last_seq or 0,
        unordered_pending=unordered[0],
        unordered_processing=unordered[1],
        unordered_dead=unordered[2],
        hints=hints,
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
    last_seq: int,
) -> tuple[State, str, datetime | None, tuple[str, ...]]:
    if behind == 0:
        stuck, after = "nothing waits behind it yet, but every new ordered message of this aggregate will", ""
    else:
        queue = f"{behind:,} ordered message{'s' if behind != 1 else ''} behind it"
        stuck = f"the {queue} cannot move"
        after = f"; the {queue} follow{'s' if behind == 1 else ''} once it is finished"
    if head is None:
        if not_numbered == 0:
            # Finished is the history rule's word (<table>_history): delivered, or skipped by
            # an operator, whose number stays unused.
            return (
                "idle",
                "nothing waits: every ordered message of this aggregate is finished (delivered, or skipped by an"
                f" operator); the next one gets aggregate_seq {last_seq + 1}",
                None,
                (),
            )
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
