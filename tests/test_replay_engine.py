"""relay.replay against a real PostgreSQL outbox, publishing to the in-memory publisher:
the plan's order and resume points, aggregates in parallel and each in order, the
failure classes, stopping and resuming, rows that go away meanwhile, and --rate.

The order oracle here is the sequence the test itself wrote into the rows (aggregate_seq
set by hand, deliberately out of id order), never the plan's own ranks. The end-to-end
tests (test_replay_e2e.py) take theirs from producers' commit logs."""

from __future__ import annotations

import asyncio
import json
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.backoff import Backoff
from relay.contract import Outcome
from relay.db.names import OutboxNames
from relay.db.replay import ReplayPlan
from relay.db.session import configure_session
from relay.errors import BrokerUnavailable, PermanentError, RetryableError
from relay.message import OutboxMessage
from relay.replay import RatePacer, Replayer, ReplayLimits, ReplayReport, Selection
from relay.testing import InMemoryPublisher
from tests.conftest import Db

FAST = ReplayLimits(
    workers=4, batch_size=10, backoff=Backoff(base=timedelta(milliseconds=1), cap=timedelta(milliseconds=5))
)


class BatchRecorder(InMemoryPublisher):
    """The in-memory publisher, also keeping each batch as it was handed over."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.batches: list[list[OutboxMessage]] = []

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        self.batches.append(list(batch))
        await asyncio.sleep(random.uniform(0, 0.003))  # batches of several workers interleave
        return await super().publish(batch)


def finish_rows(db: Db, seqs: dict[int, int | None]) -> None:
    """Mark rows done as the live relay would have left them: ``seqs`` gives each id its
    aggregate_seq (None: an unordered row)."""
    for outbox_id, seq in seqs.items():
        db.conn.execute(
            sql.SQL(
                "UPDATE {} SET status = 'done', done_at = now(), attempts = 1, lease_version = 1,"
                " ordered = %s, aggregate_seq = %s WHERE id = %s"
            ).format(db.table),
            (seq is not None, seq, outbox_id),
        )


def history(db: Db, aggregates: int, per_aggregate: int, rng: random.Random) -> dict[str, list[int]]:
    """Finished rows of ``aggregates`` ordered aggregates, interleaved, each aggregate's
    delivery order (aggregate_seq) a shuffle of its id order within windows of 4, as
    producers that do not lock leave it; and unordered rows between them. Returns each
    aggregate's ids in delivery order (the oracle)."""
    rows = [(f"agg-{a}", "OrderPlaced", {"a": a, "n": n}) for n in range(per_aggregate) for a in range(aggregates)]
    ids = db.insert(rows)
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    for outbox_id, (aggregate_id, _, _) in zip(ids, rows, strict=True):
        by_aggregate[aggregate_id].append(outbox_id)
    expected: dict[str, list[int]] = {}
    seqs: dict[int, int | None] = {}
    for aggregate_id, own in by_aggregate.items():
        order: list[int] = []
        for start in range(0, len(own), 4):
            window = own[start : start + 4]
            rng.shuffle(window)
            order += window
        expected[aggregate_id] = order
        seqs.update({outbox_id: seq for seq, outbox_id in enumerate(order, start=1)})
    unordered = db.insert([(f"agg-{a}", "EmailSent", {"a": a}) for a in range(aggregates)])
    seqs.update(dict.fromkeys(unordered))
    finish_rows(db, seqs)
    return expected


@pytest.fixture
async def conn(relay_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The replay's session, as `relay replay` opens it: the relay role's."""
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as c:
        await configure_session(c)
        yield c


async def replay(
    conn: psycopg.AsyncConnection[Any],
    names: OutboxNames,
    publisher: InMemoryPublisher,
    selection: Selection,
    limits: ReplayLimits = FAST,
    stop: asyncio.Event | None = None,
) -> ReplayReport:
    plan = ReplayPlan(conn, names)
    summary = await plan.take(selection)
    return await Replayer(plan, publisher, "run-1", limits).run(summary.count, stop or asyncio.Event())


def per_aggregate(messages: Sequence[OutboxMessage], ordered_only: bool = True) -> dict[str, list[int]]:
    got: dict[str, list[int]] = defaultdict(list)
    for m in messages:
        if m.ordered or not ordered_only:
            got[m.aggregate_id].append(m.id)
    return dict(got)


async def test_the_plan_follows_aggregate_seq_and_every_rank_knows_where_a_resume_starts(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    a = db.insert([("A", "OrderPlaced", {"i": i}) for i in range(5)])
    b = db.insert([("B", "EmailSent", {"i": i}) for i in range(2)])
    # A was delivered in the order a[1], a[2], a[0], a[4], a[3] (its commit order).
    finish_rows(db, {a[0]: 3, a[1]: 1, a[2]: 2, a[3]: 5, a[4]: 4, b[0]: None, b[1]: None})
    plan = ReplayPlan(conn, names)
    summary = await plan.take(Selection(from_id=a[0]))
    assert (summary.count, summary.first_id, summary.last_id, summary.aggregates) == (7, a[0], b[1], 2)
    rows = await plan.page(0, 100, 1 << 30)
    planned = [r.message.id for r in rows if isinstance(r.message, OutboxMessage)]
    assert [i for i in planned if i in a] == [a[1], a[2], a[0], a[4], a[3]]
    assert [i for i in planned if i in b] == b
    # Everything at or after a rank has an id of at least its resume_from, so
    # `--from-id resume_from` re-selects whatever had not been confirmed.
    for k, row in enumerate(rows):
        assert row.resume_from == min(planned[k:]), (k, planned)
    assert [r.rank for r in rows] == list(range(1, 8))
    # A page stops at its byte budget, but always holds one row.
    first = await plan.page(0, 100, 1)
    assert len(first) == 1 and first[0].rank == 1


async def test_aggregates_go_in_parallel_and_each_in_delivery_order(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    expected = history(db, aggregates=12, per_aggregate=20, rng=random.Random(7))
    publisher = BatchRecorder()
    report = await replay(conn, names, publisher, Selection(from_id=1))
    assert report.complete and report.published == 12 * 20 + 12, report
    assert per_aggregate(publisher.delivered) == expected
    for batch in publisher.batches:
        ordered = [m.aggregate_id for m in batch if m.ordered]
        assert len(ordered) == len(set(ordered)), "two messages of one aggregate in one batch"
    assert max(len(b) for b in publisher.batches) > 1, "aggregates were published one at a time"
    assert {m.replay for m in publisher.delivered} == {"run-1"}
    assert all(m.envelope()["replay"] == "run-1" for m in publisher.delivered)


async def test_only_the_selection_is_replayed(conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db) -> None:
    ids = db.insert([(f"agg-{i % 3}", ("OrderPlaced", "OrderPaid", "EmailSent")[i % 3], {}) for i in range(30)])
    finish_rows(db, dict.fromkeys(ids))
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'dead' WHERE id = %s").format(db.table), (ids[5],))
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'pending' WHERE id = %s").format(db.table), (ids[6],))
    cases = {
        Selection(from_id=ids[3], to_id=ids[9]): {i for i in ids[3:10]} - {ids[5], ids[6]},
        Selection(from_id=ids[3], to_id=ids[9], include_dead=True): {i for i in ids[3:10]} - {ids[6]},
        Selection(aggregates=("agg-1",)): {i for k, i in enumerate(ids) if k % 3 == 1 and k not in (5, 6)},
        Selection(event_types=("Order*",), to_id=ids[8]): {i for k, i in enumerate(ids[:9]) if k % 3 != 2} - {ids[6]},
        Selection(event_types=("EmailSent",)): {i for k, i in enumerate(ids) if k % 3 == 2} - {ids[5]},
    }
    for selection, want in cases.items():
        publisher = InMemoryPublisher()
        report = await replay(conn, names, publisher, selection)
        assert set(publisher.delivered_ids()) == want, selection
        assert report.published == len(want) and report.complete


async def test_a_message_that_fails_holds_back_the_rest_of_its_aggregate_and_the_resume_does_them(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    expected = history(db, aggregates=4, per_aggregate=8, rng=random.Random(3))
    broken = expected["agg-2"][3]
    refuse = {"on": True}

    def script(m: OutboxMessage) -> BaseException | None:
        return PermanentError("too large for the queue") if refuse["on"] and m.id == broken else None

    publisher = InMemoryPublisher(script=script)
    report = await replay(conn, names, publisher, Selection(from_id=1))
    assert [i for i, _ in report.failed] == [broken]
    assert "PermanentError: too large for the queue" in report.failed[0][1]
    assert report.held_back == 4 and not report.complete
    got = per_aggregate(publisher.delivered)
    assert got["agg-2"] == expected["agg-2"][:3], "nothing after the failed one"
    assert all(got[a] == expected[a] for a in expected if a != "agg-2")
    assert report.resume_from is not None and report.resume_from <= broken

    refuse["on"] = False  # the cause is fixed; the printed resume does the rest
    again = InMemoryPublisher(script=script)
    report2 = await replay(conn, names, again, Selection(from_id=report.resume_from))
    assert report2.complete
    firsts = first_deliveries([*publisher.delivered, *again.delivered])
    assert per_aggregate(firsts) == expected


def first_deliveries(messages: Sequence[OutboxMessage]) -> list[OutboxMessage]:
    seen: set[int] = set()
    out = []
    for m in messages:
        if m.id not in seen:
            seen.add(m.id)
            out.append(m)
    return out


async def test_retryable_failures_and_outages_are_waited_out_in_order(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    expected = history(db, aggregates=3, per_aggregate=6, rng=random.Random(5))
    flaky = expected["agg-0"][2]
    calls: dict[int, int] = defaultdict(int)

    def script(m: OutboxMessage) -> BaseException | None:
        calls[m.id] += 1
        if m.id == flaky and calls[m.id] <= 2:
            return RetryableError("connection reset")
        if sum(calls.values()) <= 5:
            return BrokerUnavailable("broker down")
        return None

    publisher = InMemoryPublisher(script=script)
    report = await asyncio.wait_for(replay(conn, names, publisher, Selection(from_id=1)), 60)
    assert report.complete and not report.failed, report
    assert per_aggregate(publisher.delivered) == expected
    assert calls[flaky] == 3


async def test_retries_end_after_max_attempts(conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db) -> None:
    [only] = db.insert([("A", "OrderPlaced", {})])
    finish_rows(db, {only: 1})
    publisher = InMemoryPublisher(script=lambda m: RetryableError("timeout"))
    limits = ReplayLimits(max_attempts=3, backoff=FAST.backoff)
    report = await replay(conn, names, publisher, Selection(from_id=only), limits)
    assert len(publisher.attempts) == 3
    assert report.failed and report.failed[0][1].startswith("retries exhausted after 3 attempts")


async def test_stopping_midway_leaves_a_resume_point_below_which_everything_was_confirmed(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    expected = history(db, aggregates=6, per_aggregate=30, rng=random.Random(11))
    stop = asyncio.Event()

    def script(m: OutboxMessage) -> None:
        if len(publisher.delivered) >= 60:
            stop.set()

    publisher = InMemoryPublisher(script=script)
    report = await replay(conn, names, publisher, Selection(from_id=1), stop=stop)
    assert report.interrupted and report.resume_from is not None
    selected = {i for ids in expected.values() for i in ids} | {r["id"] for r in db.rows("NOT ordered")}
    delivered = set(publisher.delivered_ids())
    assert {i for i in selected if i < report.resume_from} <= delivered
    assert len(delivered) < len(selected)
    again = InMemoryPublisher()
    report2 = await replay(conn, names, again, Selection(from_id=report.resume_from))
    assert report2.complete
    both = first_deliveries([*publisher.delivered, *again.delivered])
    assert {m.id for m in both} == selected
    assert per_aggregate(both) == expected


async def test_rows_pruned_after_the_plan_are_counted_and_skipped(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    ids = db.insert([(f"agg-{i}", "EmailSent", {}) for i in range(10)])
    finish_rows(db, dict.fromkeys(ids))
    plan = ReplayPlan(conn, names)
    summary = await plan.take(Selection(from_id=ids[0]))
    db.conn.execute(sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(db.table), (ids[2:4],))
    publisher = InMemoryPublisher()
    report = await Replayer(plan, publisher, "run-1", FAST).run(summary.count, asyncio.Event())
    assert report.gone == 2 and report.published == 8 and report.complete
    assert report.resume_from is None


async def test_a_row_whose_headers_are_refused_is_reported_not_replayed(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    ids = db.insert([("A", "OrderPlaced", {}), ("B", "OrderPlaced", {})])
    finish_rows(db, {ids[0]: 1, ids[1]: 1})
    db.conn.execute(
        sql.SQL("UPDATE {} SET headers = %s::jsonb WHERE id = %s").format(db.table), (json.dumps([1]), ids[0])
    )
    publisher = InMemoryPublisher()
    report = await replay(conn, names, publisher, Selection(from_id=ids[0]))
    assert publisher.delivered_ids() == [ids[1]]
    assert report.failed[0][0] == ids[0] and "headers are refused" in report.failed[0][1]


async def test_the_replay_changes_no_row(conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db) -> None:
    history(db, aggregates=3, per_aggregate=5, rng=random.Random(1))
    before = db.rows()
    await replay(conn, names, InMemoryPublisher(), Selection(from_id=1))
    assert db.rows() == before


def test_the_rate_pacer_spaces_batches_by_their_size() -> None:
    now = {"t": 100.0}
    pacer = RatePacer(50.0, clock=lambda: now["t"])
    assert pacer.delay(10) == 0.0  # the first batch goes at once
    assert pacer.delay(10) == pytest.approx(0.2)  # 10 messages at 50/s take 0.2 s
    now["t"] += 1.0  # idle for a second: no credit is saved up beyond one batch's turn
    assert pacer.delay(25) == 0.0
    assert pacer.delay(1) == pytest.approx(0.5)


async def test_with_tracing_each_replayed_message_gets_a_span_marked_as_the_replays(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from relay.tracing import tracing_for

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    [traced, plain] = db.insert([("A", "OrderPlaced", {}), ("B", "OrderPlaced", {})])
    finish_rows(db, {traced: 1, plain: 1})
    db.conn.execute(
        sql.SQL("UPDATE {} SET headers = %s::jsonb WHERE id = %s").format(db.table),
        (json.dumps({"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "k=v"}), traced),
    )
    tracing = tracing_for({"otel": True}, provider=provider)
    publisher = InMemoryPublisher()
    plan = ReplayPlan(conn, names)
    summary = await plan.take(Selection(from_id=traced))
    report = await Replayer(plan, publisher, "run-1", FAST, tracing=tracing).run(summary.count, asyncio.Event())
    assert report.complete
    spans = {int(str(s.attributes["outbox.id"])): s for s in exporter.get_finished_spans() if s.attributes}
    assert set(spans) == {traced, plain}
    span = spans[traced]
    assert span.name == "outbox publish OrderPlaced" and span.attributes["outbox.replay"] == "run-1"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == parent
    assert f"{span.context.trace_id:032x}" == trace_id
    sent = {m.id: m for m in publisher.delivered}
    assert sent[traced].envelope()["traceparent"] == f"00-{trace_id}-{span.context.span_id:016x}-01"
    assert sent[traced].envelope()["tracestate"] == "k=v" and sent[traced].replay == "run-1"
    assert spans[plain].parent is None, "a row without a traceparent gets a root span"


async def test_a_lost_database_stops_the_replay_with_a_resume_point_that_covers_the_rest(
    conn: psycopg.AsyncConnection[Any], names: OutboxNames, db: Db, relay_dsn: str
) -> None:
    expected = history(db, aggregates=10, per_aggregate=40, rng=random.Random(13))
    pid = conn.info.backend_pid
    killed = {"done": False}

    def script(m: OutboxMessage) -> None:
        if len(publisher.delivered) >= 40 and not killed["done"]:
            killed["done"] = True  # the replay's session is terminated (a failover, an operator)
            db.conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    publisher = InMemoryPublisher(script=script)
    plan = ReplayPlan(conn, names)
    summary = await plan.take(Selection(from_id=1))
    report = await Replayer(plan, publisher, "run-1", FAST).run(summary.count, asyncio.Event(), first_id=1)
    assert killed["done"] and report.lost_database and not report.complete
    assert report.resume_from is not None
    selected = {r["id"] for r in db.rows()}
    delivered = set(publisher.delivered_ids())
    assert {i for i in selected if i < report.resume_from} <= delivered
    assert len(delivered) < len(selected)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as again_conn:
        await configure_session(again_conn)
        again = InMemoryPublisher()
        report2 = await replay(again_conn, names, again, Selection(from_id=report.resume_from))
    assert report2.complete
    both = first_deliveries([*publisher.delivered, *again.delivered])
    assert {m.id for m in both} == selected
    assert per_aggregate(both) == expected
