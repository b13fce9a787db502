"""The operator tools' logic and rendering over hand-built objects: no PostgreSQL.

relay.db (readmodel, actions, history) is the only operator code that talks to the
database; everything these tests call takes its frozen dataclasses, so each verdict,
grouping and line is checked here from objects alone (the tests against a real database are test_ops_*.py).
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from relay.db.actions import Touched
from relay.db.history import BlockingDead
from relay.db.names import OutboxNames
from relay.db.readmodel import (
    AggregateRows,
    DeadFilter,
    DeadMessage,
    DeadPage,
    EventTypeRow,
    HeadMessage,
    SummaryRow,
    WakeupStatus,
)
from relay.db.settings import SharedSettings
from relay.errors import ConfigError
from relay.ops.deadletters import DeadGroup, DeadGroups, Refusal, WriteResult
from relay.ops.explain import explanation
from relay.ops.release import Held, ReleaseResult
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
    table,
    to_json,
)
from relay.ops.status import Status, attempt_histogram, by_event_type_status
from relay.ordering import OrderingMap
from relay.retention import HeadsResult, PruneResult
from relay.summary import summarize

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
NAMES = OutboxNames()


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


# ---- relay dead list --group


def dead(i: int, error: str | None, *, event_type: str = "OrderPlaced", blocking: bool = False) -> DeadMessage:
    return DeadMessage(
        id=i,
        aggregate_type="order",
        aggregate_id=f"order-{i}",
        event_type=event_type,
        attempts=5,
        created_at=ago(600 - i),
        last_error=error,
        ordered=True,
        lease_version=3,
        blocking=blocking,
        resolution=None,
        resolved_by=None,
        resolved_at=None,
    )


def test_dead_list_and_group_tables() -> None:
    messages = (dead(1, "boom 1", blocking=True), dead(2, None))
    page = DeadPage(at=NOW, messages=messages, total=5)
    text = render_list(page, DeadFilter())
    lines = text.splitlines()
    assert lines[0].split() == ["ID", "EVENT", "TYPE", "AGGREGATE", "ATT", "AGE", "BLOCKS", "LAST", "ERROR"]
    assert lines[1].split()[:5] == ["1", "OrderPlaced", "order-1", "5", "10m"]
    assert "yes" in lines[1] and lines[2].endswith("-")
    assert lines[3] == "3 more not shown (--limit)"
    assert lines[4].startswith("1 of these block their ordered aggregate")
    flt = DeadFilter(event_types=("X",))
    assert render_list(DeadPage(at=None, messages=(), total=0), flt) == "no dead messages match event type 'X'"
    assert render_list(DeadPage(at=None, messages=(), total=0), DeadFilter()) == "no dead messages"
    view = DeadGroups(
        tuple(DeadGroup(f"{i:016x}", f"boom {i}", 1, 0, ("OrderPlaced",), i, i, f"boom {i}", 6) for i in range(1, 3)),
        total_groups=120,
        total=240,
        page=2,
        per_page=50,
    )
    lines = render_groups(view, DeadFilter()).splitlines()
    assert lines[0].split()[:3] == ["GROUP", "COUNT", "BLOCKING"] and lines[1].startswith("0000000000000001")
    assert lines[-2:] == [
        "240 dead messages in 120 groups; re-drive one with `relay dead retry --group GROUP`",
        "page 2 of 3 (50 groups a page): --page N for another",
    ]
    past = DeadGroups((), total_groups=120, total=240, page=9, per_page=50)
    assert render_groups(past, DeadFilter()) == "no page 9: 120 groups fill 3 pages"


def test_write_results_render_and_refuse() -> None:
    changed = (Touched(7, "order-7", "OrderPlaced", 3, True), Touched(8, "order-8", "OrderPlaced", 3, False))
    done = WriteResult("retry", False, changed, (), "alice@host", "fixed the schema")
    assert done.applied
    assert render_write(done).splitlines() == [
        "Re-drove 2 dead messages to pending (attempts reset, available now, in id order)",
        "  ids: 7, 8",
        "  by: alice@host",
        "  reason: fixed the schema",
        "  ordered aggregates that resume in order: order-7",
    ]
    dry = WriteResult("skip", True, changed[:1], (), "bob", "poison")
    assert not dry.applied
    assert render_write(dry).splitlines()[0] == "dry run: would skip 1 dead message (marked done without delivery)"
    assert render_write(dry).splitlines()[-1] == "  nothing changed"
    refused = WriteResult(
        "skip", False, (), (Refusal(9, "unknown id"), Refusal(10, "not dead (status done)")), "b", "r"
    )
    assert not refused.applied
    assert refusal_line(refused) == "refused to skip (nothing changed): 9: unknown id; 10: not dead (status done)"
    # Two operators re-driving one group of 5,000 at once: the loser's line names 20 and counts the rest.
    many = WriteResult(
        "retry", False, (), tuple(Refusal(i, "not dead (status pending)") for i in range(5000)), "x", None
    )
    line = refusal_line(many)
    assert line.count("not dead") == 20 and line.endswith("; and 4,980 more (5,000 refused)") and len(line) < 1000


# ---- relay explain


READY_HEAD = HeadMessage(
    id=41,
    event_type="OrderPlaced",
    status="pending",
    attempts=0,
    last_error=None,
    available_at=ago(5),
    lease_owner=None,
    lease_until=None,
    lease_version=0,
    created_at=ago(60),
    aggregate_seq=1,
    resolution=None,
    resolved_by=None,
    resolved_at=None,
)


def head(**changes: Any) -> HeadMessage:
    return replace(READY_HEAD, **changes)


def rows(h: HeadMessage | None, *, ordered: int = 1, not_numbered: int = 0, history: bool = True) -> AggregateRows:
    return AggregateRows(
        now=NOW,
        has_heads_row=history,
        last_seq=ordered if history else None,
        head=h,
        ordered=ordered,
        not_numbered=not_numbered,
        unordered_pending=0,
        unordered_processing=0,
        unordered_dead=0,
    )


def test_explain_verdicts_from_hand_built_rows() -> None:
    blocked = explanation(NAMES, "order-1", rows(head(status="dead", attempts=5, last_error="boom"), ordered=4))
    assert blocked.state == "blocked" and blocked.waiting_behind == 3
    assert blocked.reason == "the head message #41 is dead, so the 3 ordered messages behind it cannot move"
    assert blocked.hints[0].startswith("relay dead retry 41    #")
    assert blocked.next_eligible_at is None

    lease = ago(-30)
    in_flight = explanation(
        NAMES, "a", rows(head(status="processing", lease_owner="web-1:7:0", lease_until=lease, lease_version=2))
    )
    assert in_flight.state == "in_flight" and in_flight.next_eligible_at == lease and in_flight.hints == ()

    expired = explanation(NAMES, "a", rows(head(status="processing", lease_owner="web-1:7:0", lease_until=ago(90))))
    assert expired.state == "lease_expired"
    assert "expired 90s ago" in expired.reason

    backing = explanation(NAMES, "a", rows(head(attempts=2, available_at=ago(-120))))
    assert backing.state == "backing_off" and backing.reason.endswith("waits 2m before the next one")

    ready = explanation(NAMES, "a", rows(head()))
    assert ready.state == "ready" and ready.next_eligible_at == ago(5)

    waiting = explanation(NAMES, "a", rows(None, ordered=0, not_numbered=2))
    assert waiting.state == "awaiting_ingest" and waiting.waiting_behind == 0

    idle = explanation(NAMES, "a", rows(None, ordered=0))
    assert (idle.state, idle.hints, idle.last_seq) == ("idle", (), 0)

    with pytest.raises(ConfigError, match=r"aggregate 'nope' not found in public\.outbox"):
        explanation(NAMES, "nope", rows(None, ordered=0, history=False))


def test_explain_hints_name_a_non_default_outbox_and_render() -> None:
    names = OutboxNames("shop", "events")
    e = explanation(names, "order-1", rows(head(status="dead", attempts=5), ordered=1))
    assert e.hints[0].startswith("relay dead retry 41 --schema shop --table events")
    assert "nothing waits behind it yet" in e.reason
    text = render_explanation(e, names)
    assert text.splitlines()[0] == "aggregate 'order-1' in shop.events: BLOCKED"
    assert "  next eligible never by itself: a dead message waits for an operator" in text
    assert json.loads(json.dumps(jsonable(e)))["head"]["available_at"] == ago(5).isoformat()


# ---- relay status


SUMMARY = SummaryRow(
    now=NOW,
    pending_unordered=3,
    pending_ordered=4,
    processing=2,
    expired_leases=1,
    dead=1,
    oldest_waiting_at=ago(75),
    oldest_dead_at=ago(3600),
    blocked_aggregates=1,
    oldest_blocked_at=ago(3600),
    waiting_behind_blocked=5,
    live_estimate=1_010,
    total_bytes=3 * 1024 * 1024,
)


def test_summary_ages_and_the_done_estimate() -> None:
    s = summarize(SUMMARY)
    assert (s.pending, s.awaiting, s.dead) == (7, 9, 1)
    assert s.oldest_waiting_age_s == 75.0 and s.oldest_dead_age_s == 3600.0
    assert s.done_estimate == 1_000  # live rows minus the 10 unfinished ones
    assert summarize(replace(SUMMARY, live_estimate=None)).done_estimate is None
    assert summarize(replace(SUMMARY, live_estimate=3)).done_estimate == 0  # stale statistics: never negative
    # A row created after the statement's clock (clock skew between sessions) is not negative.
    assert summarize(replace(SUMMARY, oldest_waiting_at=ago(-5))).oldest_waiting_age_s == 0.0


def test_event_type_breakdown_folds_statuses_per_type() -> None:
    breakdown = by_event_type_status(
        NOW,
        [
            EventTypeRow("B", "dead", 2, ago(900), 0),
            EventTypeRow("A", "pending", 3, ago(30), 0),
            EventTypeRow("A", "processing", 2, ago(60), 1),
            EventTypeRow("A", "dead", 1, ago(999), 0),
        ],
    )
    a, b = breakdown
    assert (a.event_type, a.pending, a.processing, a.expired_leases, a.dead) == ("A", 3, 2, 1, 1)
    assert a.oldest_waiting_age_s == 60.0  # the dead row's age does not count as waiting
    assert (b.event_type, b.dead, b.oldest_waiting_age_s) == ("B", 2, None)


def test_status_text_and_json_from_objects() -> None:
    settings = SharedSettings(OrderingMap(default_ordered=False, ordered=("Order*",)), notify=True, updated_at=NOW)
    status = Status(
        summary=summarize(SUMMARY),
        attempts={0: 6, 1: 2, 7: 1},
        by_event_type=None,
        settings=settings,
        wakeups=WakeupStatus(listening=2, idle=2, producers_notify=True),
    )
    assert attempt_histogram(status.attempts) == [
        ("0", 6), ("1", 2), ("2", 0), ("3-4", 0), ("5-8", 1), ("9-16", 0), ("17+", 0),
    ]  # fmt: skip
    text = render_status(status, NAMES, "127.0.0.1:5432/test")
    lines = text.splitlines()
    assert lines[0] == "outbox public.outbox on 127.0.0.1:5432/test, at 2026-03-01T12:00:00+00:00 (database clock)"
    assert "  pending                 7   ordered 4, unordered 3" in lines
    assert "  table size        3.0 MiB   with indexes" in lines
    assert "  oldest awaiting delivery  75s   (pending or processing)" in lines
    assert "    ordering  default unordered, ordered ['Order*'], unordered []" in lines
    assert lines[-1] == "  wake-ups       2 relay processes listening, 2 idle: producers' inserts wake them"
    out = to_json(status)
    assert out["summary"]["pending"] == 7 and out["summary"]["awaiting"] == 9
    assert "by_event_type" not in out
    assert out["settings"]["ordering"] == {"default": "unordered", "ordered": ["Order*"], "unordered": []}
    assert out["wakeups"] == {"listening": 2, "idle": 2, "producers_notify": True}
    assert json.loads(json.dumps(out))["summary"]["at"] == NOW.isoformat()
    with_types = replace(status, by_event_type=(), wakeups=WakeupStatus(0, 0, False))
    assert to_json(with_types)["by_event_type"] == []
    assert render_status(with_types, NAMES, "db").splitlines()[-1] == "  no unfinished messages of any event type"


# ---- relay prune, relay release, shared helpers


def test_prune_and_release_text() -> None:
    pruned = PruneResult(NOW, timedelta(days=7), False, True, 12, 0, 3, 10_500, 10_500)
    assert render_prune(pruned, NAMES).splitlines() == [
        "dry run: public.outbox: would delete 12 done rows finished before 2026-03-01T12:00:00+00:00 (older than 7d)",
        "  dead rows kept (--include-dead removes the unordered ones created before the cutoff)",
        "  3 batches, 10,500 rows read, stopped after id 10500",
        "  nothing changed",
    ]
    # Dead ordered rows are named by aggregate, kept, and skipped only with --skip-blocking;
    # aggregate ids are escaped and cut like every producer text.
    blocking = BlockingDead(3, 22, (*(f"order-{i}" for i in range(19)), "evil\x1b[2J" + "x" * 200))
    kept = replace(pruned, include_dead=True, dry_run=False, dead=4, blocking=blocking)
    lines = render_prune(kept, NAMES).splitlines()
    assert lines[1] == "  and 4 dead unordered rows created before it"
    assert lines[2].startswith("  kept 3 dead ordered messages created before it: each stops its aggregate")
    assert "(22 aggregates: order-0, order-1," in lines[2] and lines[2].endswith("x…(208 chars) and 2 more)")
    assert "\x1b" not in lines[2] and "evil\\x1b[2J" in lines[2]
    assert "--skip-blocking --reason TEXT" in lines[3]
    skipped = render_prune(replace(kept, skipped=2), NAMES).splitlines()
    assert skipped[2].startswith("  skipped 2 dead ordered messages created before it, recorded")
    assert "; unblocked 22 aggregates: order-0" in skipped[2]
    assert skipped[3] == "  (1 of them changed meanwhile, re-driven or skipped: left alone)"
    would = render_prune(replace(kept, skipped=3, dry_run=True), NAMES).splitlines()
    assert "would skip 3" in would[2] and "would unblock 22 aggregates" in would[2] and would[-1] == "  nothing changed"
    heads = HeadsResult(timedelta(days=90), NOW, 7, 5_000, 0)
    assert render_prune(replace(pruned, heads=heads), NAMES).splitlines()[-2] == (
        "  heads: would forget the aggregate_seq counters of 7 ordered aggregates idle for 90d (nothing unfinished,"
        " nothing numbered since 2026-03-01T12:00:00+00:00; each starts again at aggregate_seq 1 if it comes back),"
        " 5,000 heads rows read"
    )
    postponed = HeadsResult(timedelta(days=90), NOW, 0, 0, 10_000)
    assert "heads: none forgotten: 10,000 or more ordered rows wait to be numbered" in render_prune(
        replace(pruned, heads=postponed), NAMES
    )
    held = Held(5, "order-5", "OrderPlaced", "web-3:41:0", 2, ago(-60), 4, True, 1, "pending")
    result = ReleaseResult(False, NOW, "web-3", (held,), (Refusal(6, "unknown id"),), "alice", 5)
    lines = render_release(result, NAMES).splitlines()
    assert lines[0].startswith("Released 1 leased message of public.outbox held by web-3 (lease_version + 1")
    assert lines[2].split()[:5] == ["5", "order-5", "OrderPlaced", "web-3:41:0", "2"]
    assert "(in 60s)" in lines[2]
    assert "  ordered aggregates that resume in order: order-5" in lines
    assert lines[-3:] == ["  not touched:", "    6: unknown id", "  by: alice"]


def test_table_pads_left_and_right() -> None:
    assert table(("ID", "NAME"), [("7", "a"), ("123", "bb")], right=(0,)).splitlines() == [
        " ID  NAME",
        "  7  a",
        "123  bb",
    ]
