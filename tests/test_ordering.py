"""Ordered and unordered strategies, the ordering map, and the ordering scope."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay import PermanentError
from relay.db.dispatch import OutboxStore
from relay.errors import ConfigError
from relay.message import Decision
from relay.ordering import OrderingMap
from relay.testing import InMemoryPublisher
from tests.conftest import Db
from tests.helpers import make_worker
from tests.producers import CommitLog, LockedProducers, create_producer_tables, produce_unlocked


class RecordingStore(OutboxStore):
    """Records the ids whose finalize was written, in the order the writes committed."""

    finalized: list[int]

    async def finalize(self, decisions: Sequence[Decision]) -> set[int]:
        refused = await super().finalize(decisions)
        self.finalized.extend(d.message.id for d in decisions if d.message.id not in refused)
        return refused


def recording(store: OutboxStore) -> RecordingStore:
    rec = RecordingStore(store.pool, store.names)
    rec.finalized = []
    return rec


async def drain(workers: Sequence[Any], until: Callable[[], bool], timeout: float = 20) -> None:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]

    async def watch() -> None:
        while not until():
            await asyncio.sleep(0.01)
        stop.set()

    try:
        await asyncio.wait_for(watch(), timeout)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


@pytest.mark.parametrize("producers", ["locked", "unlocked"])
async def test_four_workers_finalize_one_aggregate_in_commit_order(
    store: OutboxStore, db: Db, pg_dsn: str, producer_dsn: str, producers: str
) -> None:
    """Several transactions write one aggregate (locking it first, or not), all committed
    before the relay looks; four workers then race to deliver them."""
    log = CommitLog()
    if producers == "locked":
        create_producer_tables(pg_dsn, db.names, ["order-1"], producer_dsn=producer_dsn)
        LockedProducers(producer_dsn, db.names, ["order-1"], log, threads=3, seed=4, pause_s=0.002).run(10)
    else:
        produce_unlocked(
            producer_dsn, db.names, ["order-1"], log, rounds=8, seed=4, unordered_type=None, pause_s=(0, 0)
        )
    expected = log.expected()["order-1"]
    assert len(expected) >= 20
    rec = recording(store)
    publisher = InMemoryPublisher(delay=0.002)
    workers = [make_worker(rec, owner=f"w{i}", publisher=publisher)[0] for i in range(4)]
    await drain(workers, lambda: len(rec.finalized) == len(expected))
    assert rec.finalized == expected
    assert publisher.delivered_ids() == expected
    assert [m.aggregate_seq for m in publisher.delivered] == list(range(1, len(expected) + 1))
    assert sum(1 for w in workers if w.stats.published) >= 2, "one worker did everything; no race was tested"
    assert db.statuses() == {"done": len(expected)}


async def test_unordered_types_are_taken_in_parallel(make_store: Callable[..., Awaitable[OutboxStore]], db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=False))
    db.insert(("order-1", "Notify", {"i": i}) for i in range(30))
    claim = await store.claim(owner="A", batch=100, lease=_lease(), max_attempts=3)
    assert len(claim.messages) == 30  # no head rule: the whole aggregate at once


async def test_ordered_claim_takes_only_heads(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {}), ("b", "E", {}), ("c", "E", {}), ("c", "E", {})])
    claim = await store.claim(owner="A", batch=100, lease=_lease(), max_attempts=3)
    assert [m.id for m in claim.messages] == [ids[0], ids[2], ids[3]]
    # A second worker finds nothing: each head is processing, the rest wait behind them.
    again = await store.claim(owner="B", batch=100, lease=_lease(), max_attempts=3)
    assert again.messages == []


async def test_dead_head_blocks_its_aggregate_while_others_flow(store: OutboxStore, db: Db) -> None:
    blocked = db.insert([("a", "E", {"poison": True}), ("a", "E", {}), ("a", "E", {})])
    flowing = db.insert([("b", "E", {}), ("b", "E", {}), ("c", "E", {})])

    def script(m: Any) -> BaseException | None:
        return PermanentError("rejected") if m.payload().get("poison") else None

    worker, pub = make_worker(store, script)
    for _ in range(5):
        await worker.run_once()
    delivered = pub.delivered_ids()
    assert sorted(delivered) == flowing
    assert delivered.index(flowing[0]) < delivered.index(flowing[1])  # b's two events in order
    assert [db.row(i)["status"] for i in blocked] == ["dead", "pending", "pending"]
    assert await worker.run_once() == 0  # still blocked, however often we look


async def test_processing_head_blocks_until_finalized(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "E", {}), ("a", "E", {})])
    [head] = (await store.claim(owner="A", batch=10, lease=_lease(), max_attempts=3)).messages
    assert head.id == ids[0]
    await store.finalize([Decision.retry(head, 0.0, "RetryableError: later")])
    # The head failed and was rescheduled: it is pending again and still blocks id 2.
    [again] = (await store.claim(owner="B", batch=10, lease=_lease(), max_attempts=3)).messages
    assert again.id == ids[0]
    await store.finalize([Decision.published(again)])
    [nxt] = (await store.claim(owner="C", batch=10, lease=_lease(), max_attempts=3)).messages
    assert nxt.id == ids[1]


async def test_scope_unordered_events_neither_wait_nor_block(
    make_store: Callable[..., Awaitable[OutboxStore]], db: Db
) -> None:
    """Ordering scope: the ordered events of one aggregate form one sequence; unordered
    events of the same aggregate are outside it."""
    store = await make_store(OrderingMap(default_ordered=False, ordered=("Order*",)))
    ids = db.insert(
        [
            ("o1", "OrderCreated", {"poison": True}),  # ordered head: will die
            ("o1", "EmailSent", {}),  # unordered: must not wait behind the dead head
            ("o1", "OrderPaid", {}),  # ordered: must wait behind the dead head
            ("o1", "EmailSent", {"poison": True}),  # unordered and dead: must not block anything
            ("o2", "OrderCreated", {}),
        ]
    )

    def script(m: Any) -> BaseException | None:
        return PermanentError("bad") if m.payload().get("poison") else None

    worker, pub = make_worker(store, script)
    for _ in range(4):
        await worker.run_once()
    assert [db.row(i)["status"] for i in ids] == ["dead", "done", "pending", "dead", "done"]
    # Now skip the dead ordered head by hand (an operator's choice): OrderPaid moves, even
    # though the dead unordered EmailSent (id 4) stands before it.
    db.conn.execute(
        psycopg.sql.SQL("UPDATE {} SET status = 'done', done_at = now() WHERE id = %s").format(db.table),
        (ids[0],),
    )
    await worker.run_once()
    assert db.row(ids[2])["status"] == "done"
    assert set(pub.delivered_ids()) == {ids[1], ids[2], ids[4]}


async def test_messages_carry_their_strategy(make_store: Callable[..., Awaitable[OutboxStore]], db: Db) -> None:
    store = await make_store(OrderingMap(default_ordered=True, unordered=("Email*",)))
    db.insert([("a", "OrderCreated", {}), ("a", "EmailSent", {})])
    claim = await store.claim(owner="A", batch=10, lease=_lease(), max_attempts=3)
    assert [(m.event_type, m.ordered) for m in claim.messages] == [
        ("OrderCreated", True),
        ("EmailSent", False),
    ]


# -- the ordering map ----------------------------------------------------------------


def test_map_precedence_exact_then_glob_then_default() -> None:
    m = OrderingMap(default_ordered=False, ordered=("Order*", "PaymentCaptured"), unordered=("OrderViewed", "*Log*"))
    assert m.is_ordered("OrderCreated")  # glob in ordered
    assert not m.is_ordered("OrderViewed")  # an exact name beats the ordered glob
    assert m.is_ordered("PaymentCaptured")  # exact
    assert not m.is_ordered("AuditLogWritten")  # unordered glob
    assert m.is_ordered("OrderLogged")  # both globs match: ordered wins
    assert not m.is_ordered("Shipped")  # default
    assert OrderingMap(default_ordered=True).is_ordered("Anything")


def test_map_from_config_and_its_errors() -> None:
    m = OrderingMap.from_config({"default": "unordered", "ordered": ["Order*"]})
    assert m.is_ordered("OrderPaid") and not m.is_ordered("Ping")
    with pytest.raises(ConfigError, match="both ordered and unordered"):
        OrderingMap.from_config({"ordered": ["A"], "unordered": ["A"]})
    with pytest.raises(ConfigError, match="invalid ordering default"):
        OrderingMap.from_config({"default": "sometimes"})
    with pytest.raises(ConfigError, match="unknown key"):
        OrderingMap.from_config({"orderd": ["A"]})
    with pytest.raises(ConfigError, match="non-empty"):
        OrderingMap(ordered=("",))


_NAMES = st.text(alphabet="AOrdeP*?[]!-._x", min_size=0, max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    default=st.booleans(),
    ordered=st.lists(_NAMES.filter(bool), max_size=3),
    unordered=st.lists(_NAMES.filter(bool), max_size=3),
    event_types=st.lists(st.text(alphabet="AOrdeP-._x[]!*?", max_size=8), min_size=1, max_size=6),
)
def test_database_classifier_agrees_with_python(
    db: Db, default: bool, ordered: list[str], unordered: list[str], event_types: list[str]
) -> None:
    """The claims route rows with the migrated SQL twin of OrderingMap.is_ordered; they must agree."""
    try:
        m = OrderingMap(default_ordered=default, ordered=tuple(ordered), unordered=tuple(unordered))
    except ConfigError:
        return
    function = psycopg.sql.Identifier(db.names.schema, "outbox_is_ordered")
    query = psycopg.sql.SQL(
        "SELECT {}(%(e)s, %(ord_names)s, %(unord_names)s, %(ord_patterns)s, %(unord_patterns)s, %(ord_default)s)"
    ).format(function)
    for event_type in event_types:
        cur = db.conn.execute(query, {"e": event_type, **m.sql_params()})
        assert cur.fetchone() == (m.is_ordered(event_type),), (event_type, m)


def _lease():  # type: ignore[no-untyped-def]
    from datetime import timedelta

    return timedelta(seconds=30)
