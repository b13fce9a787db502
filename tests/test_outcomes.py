"""Each failure class, end to end through a worker, the in-memory publisher and a real table."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from relay import BrokerUnavailable, Defer, PermanentError, RetryableError
from relay.backoff import Backoff
from relay.db.dispatch import OutboxStore
from relay.errors import NotSent
from relay.testing import STALL, InMemoryPublisher
from tests.conftest import Db
from tests.helpers import make_worker


def delay_of(db: Db, oid: int) -> float:
    """How far in the future the row's available_at is, by the database clock."""
    cur = db.conn.execute(
        f"SELECT extract(epoch FROM available_at - now())::float8 FROM {db.names.schema}.outbox WHERE id = %s",
        (oid,),
    )
    row = cur.fetchone()
    assert row is not None
    return float(row[0])


async def test_success_marks_done(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "Ping", {"n": 1}), ("b", "Ping", {"n": 2})])
    worker, pub = make_worker(store)
    assert await worker.run_once() == 2
    assert pub.delivered_ids() == ids
    assert [r["status"] for r in db.rows()] == ["done", "done"]
    assert all(r["done_at"] is not None and r["lease_owner"] is None for r in db.rows())
    assert worker.stats.published == 2


async def test_defer_refunds_the_attempt_and_waits(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(store, lambda m: Defer(timedelta(seconds=30), "stock not reserved yet"))
    for _ in range(5):  # five defers in a row must not exhaust max_attempts=3
        await worker.run_once()
        row = db.row(oid)
        assert row["status"] == "pending"
        assert row["attempts"] == 0
        assert 25 < delay_of(db, oid) <= 30
        assert row["last_error"] == "deferred: stock not reserved yet"
        db.make_available()
    assert db.row(oid)["lease_version"] == 5
    assert worker.stats.deferred == 5


async def test_defer_past_the_age_ceiling_goes_dead(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(
        store, lambda m: Defer(timedelta(minutes=10), "waiting"), defer_max_age=timedelta(minutes=5)
    )
    await worker.run_once()
    row = db.row(oid)
    assert row["status"] == "dead"
    assert "defer_max_age" in row["last_error"]


async def test_held_back_by_the_adapters_own_limit_never_goes_dead_for_its_age(store: OutboxStore, db: Db) -> None:
    """NotSent (a rate or a connection limit of the adapter's own): the attempt refunded,
    like a Defer, and no age ceiling: a backlog behind a rate limit must not die unsent."""
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(
        store,
        lambda m: NotSent(timedelta(seconds=1), "not sent: --http-rate gave no turn early enough"),
        defer_max_age=timedelta(seconds=0),
    )
    for _ in range(3):
        await worker.run_once()
        row = db.row(oid)
        assert (row["status"], row["attempts"]) == ("pending", 0)
        db.make_available()


async def test_retryable_backs_off_within_full_jitter_bounds_then_dies(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    backoff = Backoff(base=timedelta(seconds=10), cap=timedelta(seconds=25))
    worker, pub = make_worker(store, lambda m: RetryableError("503 from broker"), max_attempts=4, backoff=backoff)
    for attempt, ceiling in ((1, 10.0), (2, 20.0), (3, 25.0)):  # base * 2**(n-1), capped
        await worker.run_once()
        row = db.row(oid)
        assert row["status"] == "pending"
        assert row["attempts"] == attempt
        assert 0 <= delay_of(db, oid) <= ceiling + 0.5
        assert row["last_error"] == "RetryableError: 503 from broker"
        db.make_available()
    await worker.run_once()
    row = db.row(oid)
    assert row["status"] == "dead" and row["attempts"] == 4
    assert row["last_error"].startswith("retries exhausted after 4 attempts")
    assert len(pub.attempts) == 4


def test_full_jitter_draws_cover_the_whole_range() -> None:
    backoff = Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=300))
    draws = [backoff.delay(4).total_seconds() for _ in range(2000)]
    assert min(draws) >= 0 and max(draws) <= 8
    assert min(draws) < 0.5 and max(draws) > 7.5  # uniform over [0, 8], not clustered at the cap
    assert backoff.ceiling(30) == 300
    assert backoff.ceiling(10_000) == 300  # no overflow for absurd attempt counts


async def test_permanent_goes_dead_at_once(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(store, lambda m: PermanentError("message too large"), max_attempts=10)
    await worker.run_once()
    row = db.row(oid)
    assert (row["status"], row["attempts"]) == ("dead", 1)
    assert row["last_error"] == "PermanentError: message too large"
    assert row["lease_until"] is None


async def test_unclassified_error_is_not_retried_as_transient(
    store: OutboxStore, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(store, lambda m: KeyError("boom"), max_attempts=10)
    await worker.run_once()
    row = db.row(oid)
    assert row["status"] == "dead"
    assert row["attempts"] == 1
    assert "unclassified publisher error" in row["last_error"]
    assert any("unclassified" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_publisher_raising_for_the_whole_batch_applies_to_every_message(store: OutboxStore, db: Db) -> None:
    db.insert([("a", "Ping", {}), ("b", "Ping", {})])

    class Raising(InMemoryPublisher):
        async def publish(self, batch):  # type: ignore[no-untyped-def]
            raise RetryableError("connection reset")

    worker, _ = make_worker(store, publisher=Raising())
    await worker.run_once()
    assert [(r["status"], r["attempts"]) for r in db.rows()] == [("pending", 1), ("pending", 1)]


async def test_an_unclassified_raise_for_the_whole_batch_is_paid_by_the_message_that_raises_alone(
    store: OutboxStore, db: Db
) -> None:
    """A publisher that raises something unexpected for a batch (an adapter bug that one
    message's content triggers) does not decide its neighbours' outcomes: the worker
    publishes them apart, the others are delivered and only the culprit goes to dead."""
    ids = db.insert([("a", "Ping", {"k": "ok"}), ("b", "Ping", {"k": "bad"}), ("c", "Ping", {"k": "ok"})])

    class RaisesOnBad(InMemoryPublisher):
        async def publish(self, batch):  # type: ignore[no-untyped-def]
            if any(m.payload()["k"] == "bad" for m in batch):
                raise RecursionError("maximum recursion depth exceeded")
            return await super().publish(batch)

    worker, pub = make_worker(store, publisher=RaisesOnBad(), max_attempts=5)
    await worker.run_once()
    rows = {r["id"]: r for r in db.rows()}
    assert pub.delivered_ids() == [ids[0], ids[2]]
    assert [rows[i]["status"] for i in ids] == ["done", "dead", "done"]
    assert "unclassified publisher error" in rows[ids[1]]["last_error"]
    assert "RecursionError" in rows[ids[1]]["last_error"]


async def test_each_message_keeps_what_one_send_raises_to_that_message() -> None:
    from relay.contract import each_message
    from relay.message import OutboxMessage

    def message(i: int) -> OutboxMessage:
        return OutboxMessage(i, "t", f"a{i}", "Ping", b"{}", attempt=1, lease_version=1, ordered=False)

    async def send(m: OutboxMessage) -> BaseException | None:
        if m.id == 2:
            raise ValueError("odd answer")
        return None if m.id != 3 else RetryableError("later")

    outcomes = await each_message([message(1), message(2), message(3)], send)
    assert outcomes[0] is None
    assert isinstance(outcomes[1], ValueError)
    assert isinstance(outcomes[2], RetryableError)


async def test_each_message_in_lanes_keeps_each_outcome_its_own_and_holds_to_the_lanes() -> None:
    from relay.contract import each_message
    from relay.message import OutboxMessage

    running, most = 0, 0

    async def send(m: OutboxMessage) -> BaseException | None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        if m.id % 5 == 0:
            raise ValueError("odd answer")
        if m.id % 7 == 0:
            raise asyncio.CancelledError  # this send alone, not the publish
        return None

    batch = [
        OutboxMessage(i, "t", f"a{i}", "Ping", b"{}", attempt=1, lease_version=1, ordered=False) for i in range(1, 31)
    ]
    outcomes = await each_message(batch, send, at_once=4)
    assert most == 4
    assert [i for i, o in enumerate(outcomes, 1) if isinstance(o, ValueError)] == [5, 10, 15, 20, 25, 30]
    assert [i for i, o in enumerate(outcomes, 1) if isinstance(o, RetryableError)] == [7, 14, 21, 28]
    assert sum(o is None for o in outcomes) == 30 - 6 - 4

    # Cancelling the publish cancels every lane: nothing goes on sending afterwards.
    sent: list[int] = []

    async def slow(m: OutboxMessage) -> None:
        await asyncio.sleep(0.05)
        sent.append(m.id)

    publish = asyncio.ensure_future(each_message(batch, slow, at_once=3))
    await asyncio.sleep(0.12)
    publish.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publish
    so_far = len(sent)
    await asyncio.sleep(0.2)
    assert len(sent) == so_far < 30


async def test_publish_timeout_is_retryable(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(store, lambda m: STALL, publish_timeout=timedelta(milliseconds=100))
    await worker.run_once()
    row = db.row(oid)
    assert row["status"] == "pending" and row["attempts"] == 1
    assert row["last_error"] == "RetryableError: publish timed out after 0.1s"


async def test_broker_unavailable_spends_no_attempt_and_sends_nothing_dead(store: OutboxStore, db: Db) -> None:
    [oid] = db.insert([("a", "Ping", {})])
    worker, _ = make_worker(store, lambda m: BrokerUnavailable("queue q does not exist"), max_attempts=2)
    for _ in range(6):
        await worker.run_once()
        db.make_available()
    row = db.row(oid)
    assert row["status"] == "pending" and row["attempts"] == 0
    assert "queue q does not exist" in row["last_error"]


async def test_outcomes_are_per_message_within_a_batch(store: OutboxStore, db: Db) -> None:
    ids = db.insert([("a", "Ping", {"k": "ok"}), ("b", "Ping", {"k": "retry"}), ("c", "Ping", {"k": "perm"})])
    outcomes = {"ok": None, "retry": RetryableError("later"), "perm": PermanentError("never")}
    worker, pub = make_worker(store, lambda m: outcomes[m.payload()["k"]])
    await worker.run_once()
    assert [r["status"] for r in db.rows()] == ["done", "pending", "dead"]
    assert pub.delivered_ids() == [ids[0]]


async def test_lost_lease_is_logged_and_never_overwrites(
    store: OutboxStore, db: Db, caplog: pytest.LogCaptureFixture
) -> None:
    [oid] = db.insert([("a", "Ping", {})])

    def steal(message):  # type: ignore[no-untyped-def]
        # While "publishing", the lease is lost and another worker claims the row.
        db.expire_leases()
        db.conn.execute(
            f"UPDATE {db.names.schema}.outbox SET lease_version = lease_version + 1,"
            " lease_owner = 'thief', lease_until = now() + interval '1 minute' WHERE id = %s",
            (message.id,),
        )
        return None

    worker, _ = make_worker(store, steal)
    await worker.run_once()
    row = db.row(oid)
    assert (row["status"], row["lease_owner"], row["lease_version"]) == ("processing", "thief", 2)
    assert worker.stats.lost_leases == 1
    [warning] = [r for r in caplog.records if "lost lease" in r.getMessage()]
    assert warning.outbox_id == oid and warning.lease_version == 1  # type: ignore[attr-defined]


class _SlowAfterCommit(OutboxStore):
    """A store whose claim returns only ``claim_hold_s`` after its transaction committed,
    and whose finalize starts ``finalize_hold_s`` late: the moments at which a shutdown's cancel can
    reach a worker between the database having done something and the worker knowing, or
    between a publish and the write that records it."""

    claim_hold_s = 1.0
    finalize_hold_s = 0.0
    claimed: asyncio.Event
    finalizing: asyncio.Event

    async def claim(self, **kwargs):  # type: ignore[no-untyped-def]
        result = await super().claim(**kwargs)
        if result.messages:
            self.claimed.set()
            await asyncio.sleep(self.claim_hold_s)
        return result

    async def finalize(self, decisions):  # type: ignore[no-untyped-def]
        self.finalizing.set()
        await asyncio.sleep(self.finalize_hold_s)
        return await super().finalize(decisions)


def _slow_store(store: OutboxStore) -> _SlowAfterCommit:
    slow = _SlowAfterCommit(store.pool, store.names)
    slow.claimed, slow.finalizing = asyncio.Event(), asyncio.Event()
    return slow


async def test_a_worker_cancelled_while_its_claim_commits_hands_the_rows_back(store: OutboxStore, db: Db) -> None:
    """Cancelled after the claim committed but before it returned (a framework's shutdown):
    the worker still learns what it leased and hands it back, attempts refunded, instead of
    leaving the rows leased until the lease runs out (an attempt spent each)."""
    db.insert([("a", "Ping", {}), ("b", "Ping", {})])
    slow = _slow_store(store)
    worker, pub = make_worker(slow)
    task = asyncio.create_task(worker.run(asyncio.Event()))
    await asyncio.wait_for(slow.claimed.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    rows = db.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0), ("pending", 0)], rows
    assert pub.attempts == []


async def test_a_worker_cancelled_while_it_records_outcomes_ends_only_once_they_are_written(
    store: OutboxStore, db: Db
) -> None:
    """The write of what the broker has is not abandoned to run on after the worker ended
    (the runner closes the pool once every worker has ended)."""
    db.insert([("a", "Ping", {}), ("b", "Ping", {})])
    slow = _slow_store(store)
    slow.claim_hold_s, slow.finalize_hold_s = 0.0, 0.5
    worker, pub = make_worker(slow)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(slow.finalizing.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Nothing of the worker runs on: the rows are as the finalize left them, at once.
    assert [r["status"] for r in db.rows()] == ["done", "done"]
    assert len(pub.delivered) == 2
