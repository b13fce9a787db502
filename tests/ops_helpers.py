"""Shared arrangements for the operator-tool tests (test_ops_*.py) and the CLI tests that reuse them.

Rows reach 'dead', 'processing' and expired leases through the relay's own claim and
finalize, never by hand, so the heads table is exactly what a running relay would leave.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.message import Decision, OutboxMessage
from relay.worker import Worker
from tests.conftest import Db
from tests.relay_process import run_relay

LEASE = timedelta(seconds=30)


# Ingest offers a new ordered row only once no older transaction is open anywhere in the
# cluster, so on a shared database (other test runs, benchmarks) a claim can briefly find
# nothing; the helpers below retry until what they wait for happens, for this long.
PATIENCE_S = 15.0


async def claim(store: OutboxStore, batch: int = 100, owner: str = "w") -> list[OutboxMessage]:
    """One claim (with ingest and reaper), as a worker would make it."""
    return (await store.claim(owner=owner, batch=batch, lease=LEASE, max_attempts=3)).messages


async def claim_until(store: OutboxStore, want: set[int], owner: str = "w") -> dict[int, OutboxMessage]:
    """Claim until every id of ``want`` was claimed; every message claimed on the way, by id."""
    got: dict[int, OutboxMessage] = {}
    deadline = time.monotonic() + PATIENCE_S
    while not want <= set(got):
        got.update((m.id, m) for m in await claim(store, owner=owner))
        if time.monotonic() > deadline:
            raise AssertionError(f"never claimed {sorted(want - set(got))}")
        await asyncio.sleep(0.02)
    return got


async def ingest(store: OutboxStore, db: Db, aggregate_id: str) -> None:
    """Offer new ordered rows to the heads table, without claiming, until ``aggregate_id`` has a head."""
    heads = sql.Identifier(db.names.schema, f"{db.names.table}_heads")
    deadline = time.monotonic() + PATIENCE_S
    while True:
        await store.claim(owner="ingest", batch=0, lease=LEASE, max_attempts=3)
        row = db.conn.execute(
            sql.SQL("SELECT head_id FROM {} WHERE aggregate_id = %s").format(heads), (aggregate_id,)
        ).fetchone()
        if row is not None and row[0] is not None:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"aggregate {aggregate_id!r} never got a head")
        await asyncio.sleep(0.02)


async def run_until(worker: Worker, done: Callable[[], bool]) -> None:
    """Run ``worker`` one batch at a time until ``done()``."""
    deadline = time.monotonic() + PATIENCE_S
    while not done():
        if not await worker.run_once():
            await asyncio.sleep(0.02)
        if time.monotonic() > deadline:
            raise AssertionError("the worker never got there")


async def kill(store: OutboxStore, messages: list[OutboxMessage], error: str) -> None:
    """Finalize claimed ``messages`` as dead with ``error``."""
    refused = await store.finalize([Decision.dead(m, error) for m in messages])
    assert not refused


def expire(db: Db, *ids: int) -> None:
    """Move the leases of ``ids`` into the past."""
    db.conn.execute(
        sql.SQL("UPDATE {} SET lease_until = now() - interval '5 seconds' WHERE id = ANY(%s)").format(db.table),
        (list(ids),),
    )


@dataclass
class Scene:
    """The standard picture for status and explain (default ordered, Email* unordered):

    * aggregate ``a``: head a1 dead, a2 and a3 waiting behind it (blocked)
    * aggregate ``b``: head b1 leased by worker ``w`` (in flight), b2 waiting
    * aggregate ``c``: head c1 leased, lease expired
    * aggregate ``d``: two unordered EmailQueued rows, pending
    * aggregate ``e``: one ordered row written after the claim, not yet ingested
    """

    a: list[int]
    b: list[int]
    c: list[int]
    d: list[int]
    e: list[int]


async def build_scene(store: OutboxStore, db: Db) -> Scene:
    a = db.insert([("a", "OrderPlaced", {"n": i}) for i in range(3)])
    b = db.insert([("b", "OrderPlaced", {}), ("b", "OrderPaid", {})])
    c = db.insert([("c", "OrderPaid", {})])
    heads = await claim_until(store, {a[0], b[0], c[0]})
    assert sorted(heads) == [a[0], b[0], c[0]]
    await kill(store, [heads[a[0]]], f"PermanentError: order {a[0]} rejected (code 4711)")
    expire(db, c[0])
    d = db.insert([("d", "EmailQueued", {}), ("d", "EmailQueued", {})])
    e = db.insert([("e", "OrderPlaced", {})])
    return Scene(a=a, b=b, c=c, d=d, e=e)


def run_parallel(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run several independent ``relay`` commands at once (each start costs most of a second)."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda args: run_relay(*args), commands))


def relay_json(*args: str) -> Any:
    """Run ``relay ARGS --json`` and parse its stdout."""
    proc = run_relay(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def target(dsn: str, db: Db) -> list[str]:
    """The flags naming the test's outbox, reached as ``dsn``: the relay role's
    (``relay_dsn``) for the operator commands, whose every statement its grants cover."""
    return ["--dsn", dsn, "--schema", db.names.schema]


def group_key(dsn: str, names: Any, error: str | None) -> str:
    """The key `relay dead list --group` shows for ``error``: the outbox's own SQL function
    (migration 0014), never a copy of its rules."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT {}(%s)").format(sql.Identifier(names.schema, f"{names.table}_dead_group")), (error,)
        ).fetchone()
    assert row is not None
    return f"{row[0] & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def fingerprint(dsn: str, names: Any, error: str | None) -> str:
    """``error``'s fingerprint, by the outbox's SQL function."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT {}(%s)").format(sql.Identifier(names.schema, f"{names.table}_fingerprint")), (error,)
        ).fetchone()
    assert row is not None
    return str(row[0])
