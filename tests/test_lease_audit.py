"""The fault suite's lease audit (tests/lease_audit.py) against real claims and finalizes:
clean for the relay's own fenced statements, and failing on a finalize without its fence,
the bug it exists to catch."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.statements import named_queries
from relay.message import Decision, OutboxMessage
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.deliveries import Delivery
from tests.lease_audit import install_lease_audit, lease_audit_problems

FENCE = "   AND o.lease_version = f.version\n"
LEASE = timedelta(minutes=5)


@pytest.fixture
def audited(pg_dsn: str, names: OutboxNames) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the owner: it creates the trigger
        install_lease_audit(conn, names)
        yield conn


def delivered(m: OutboxMessage) -> Delivery:
    return Delivery(m.id, m.aggregate_id, m.event_type, m.lease_version, None)


async def claim_one(store: OutboxStore, owner: str) -> OutboxMessage:
    claim = await store.claim(owner=owner, batch=1, lease=LEASE, max_attempts=5)
    [m] = claim.messages
    return m


async def take_over(store: OutboxStore, db: Db) -> tuple[OutboxMessage, OutboxMessage]:
    """Worker A claims the row, its lease runs out, worker B claims it again."""
    db.insert([("agg", "E", {})])
    a = await claim_one(store, "a")
    db.expire_leases()
    b = await claim_one(store, "b")
    assert (a.id, a.lease_version + 1) == (b.id, b.lease_version)
    return a, b


async def test_the_relays_fenced_statements_leave_a_clean_audit(
    make_store: Any, db: Db, names: OutboxNames, audited: psycopg.Connection[Any]
) -> None:
    store: OutboxStore = await make_store(OrderingMap(default_ordered=False))
    a, b = await take_over(store, db)
    assert await store.finalize([Decision.published(a)]) == {a.id}  # A is late: refused
    assert await store.finalize([Decision.published(b)]) == set()
    assert db.row(b.id)["lease_version"] == b.lease_version
    assert lease_audit_problems(audited, names, [delivered(a), delivered(b)]) == []


async def test_a_finalize_without_its_fence_is_caught(
    make_store: Any, db: Db, names: OutboxNames, audited: psycopg.Connection[Any]
) -> None:
    store: OutboxStore = await make_store(OrderingMap(default_ordered=False))
    a, b = await take_over(store, db)
    text = named_queries()["finalize"]
    assert FENCE in text
    store._sql["finalize"] = names.render(text.replace(FENCE, ""))  # the bug: no fence
    assert await store.finalize([Decision.published(a)]) == set()  # A's late write lands
    problems = lease_audit_problems(audited, names, [delivered(a), delivered(b)])
    assert problems and f"id {a.id}: lease_version went back from {b.lease_version} to {a.lease_version}" in problems
