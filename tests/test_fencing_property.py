"""Property: whatever the interleaving of claims, crashes, lease expiries and finalizes,
a worker whose claim is not the newest never writes, and the newest always can."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.message import Decision, OutboxMessage
from relay.ordering import OrderingMap
from tests.conftest import Db

MAX_ATTEMPTS = 3
WORKERS = 3

ops = st.lists(
    st.one_of(
        st.tuples(st.just("claim"), st.integers(0, WORKERS - 1)),
        st.tuples(st.just("crash"), st.integers(0, WORKERS - 1)),
        st.tuples(st.just("expire")),
        st.tuples(st.just("finalize"), st.integers(0, WORKERS - 1), st.sampled_from(["done", "retry", "dead"])),
    ),
    min_size=1,
    max_size=25,
)


@dataclass
class Model:
    status: str = "pending"
    attempts: int = 0
    version: int = 0
    expired: bool = False


def decision(kind: str, m: OutboxMessage) -> Decision:
    if kind == "done":
        return Decision.published(m)
    if kind == "retry":
        return Decision.retry(m, 0.0, "RetryableError: x")
    return Decision.dead(m, "PermanentError: x")


# 80 random interleavings per run (150 took 14 s) beside the reference's timeline, always tried.
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops)
# The reference's timeline, always tried: A claims, its lease expires, B takes over, A's late
# finalize must be refused while B's succeeds.
@example(steps=[("claim", 0), ("expire",), ("claim", 1), ("finalize", 0, "done"), ("finalize", 1, "retry")])
async def test_stale_workers_never_write(make_store: Any, db: Db, steps: list[tuple[Any, ...]]) -> None:
    store: OutboxStore = await make_store(OrderingMap(default_ordered=False))
    # Each example starts with one fresh row; earlier examples' rows are retired.
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'done', lease_until = NULL").format(db.table))
    [oid] = db.insert([("agg", "E", {})])
    model = Model()
    held: dict[int, OutboxMessage] = {}

    for step in steps:
        if step[0] == "claim":
            w = step[1]
            claim = await store.claim(owner=f"w{w}", batch=5, lease=timedelta(minutes=5), max_attempts=MAX_ATTEMPTS)
            if model.status == "processing" and model.expired and model.attempts >= MAX_ATTEMPTS:
                model.status = "dead"  # reaped
                assert [r.id for r in claim.reaped] == [oid]
            claimable = model.status == "pending" or (
                model.status == "processing" and model.expired and model.attempts < MAX_ATTEMPTS
            )
            if claimable:
                [m] = claim.messages
                model.version += 1
                model.attempts += 1
                model.status, model.expired = "processing", False
                assert (m.lease_version, m.attempt) == (model.version, model.attempts)
                held[w] = m
            else:
                assert claim.messages == []
        elif step[0] == "crash":
            held.pop(step[1], None)
        elif step[0] == "expire":
            db.expire_leases()
            model.expired = model.status == "processing"
        else:
            w, kind = step[1], step[2]
            if w not in held:
                continue
            m = held.pop(w)
            before = db.row(oid)
            refused = await store.finalize([decision(kind, m)])
            newest = model.status == "processing" and m.lease_version == model.version
            if newest:
                assert refused == set()
                model.status = {"done": "done", "retry": "pending", "dead": "dead"}[kind]
                model.expired = False
            else:
                assert refused == {oid}
                assert db.row(oid) == before  # a stale write changed nothing at all
        row = db.row(oid)
        assert (row["status"], row["attempts"], row["lease_version"]) == (
            model.status,
            model.attempts,
            model.version,
        )
