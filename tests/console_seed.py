"""A known outbox for the console's tests and screenshots, made the way the relay makes it:
producers insert (as the producer role), a store claims, and finalize writes dead or
hands back. What it holds is returned, so tests compare the pages with it, not with the
console's own reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from psycopg_pool import AsyncConnectionPool

from relay.console.app import Console, ConsoleConfig, make_app
from relay.console.auth import Guard, parse_token
from relay.console.history import History
from relay.console.server import start_sampling
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.session import open_pool
from relay.dsn import describe_dsn
from relay.message import Decision
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.ops_helpers import claim_until

ORDERING = OrderingMap(default_ordered=True, unordered=("Email*",))
BILLING_500 = "PermanentError: billing answered 500 for order {n} (request {req})"
SCHEMA = "PermanentError: payload rejected by the orders schema: field 'total' missing"
MAILER = "PermanentError: mailer refused address '{addr}'"


@dataclass(frozen=True)
class Seeded:
    dead_heads: dict[str, int]  # ordered aggregate -> its dead head's id
    behind: dict[str, list[int]]  # ordered aggregate -> the ids waiting behind its dead head, in order
    billing: list[int]  # the dead ids whose error is BILLING_500 (one group)
    schema: list[int]  # ... SCHEMA (another group)
    mailer: list[int]  # unordered dead, MAILER
    pending: list[int]  # everything else, pending
    dead: int


async def seed(store: OutboxStore, db: Db) -> Seeded:
    """Three ordered aggregates blocked by a dead head (two by one billing error, one by a
    schema error), two unordered dead emails, and pending messages behind and beside them."""
    heads = {
        "order-17": db.insert([("order-17", "OrderPlaced", {"order": 17, "total": 120})])[0],
        "order-23": db.insert([("order-23", "OrderPlaced", {"order": 23, "total": 75})])[0],
        "order-31": db.insert([("order-31", "OrderPlaced", {"order": 31})])[0],
    }
    emails = db.insert([("cust-5", "EmailQueued", {"to": "a@example.com"}), ("cust-6", "EmailQueued", {"to": "b@"})])
    claimed = await claim_until(store, {*heads.values(), *emails}, owner="seed")
    errors = {
        heads["order-17"]: BILLING_500.format(n=17, req="9f86d081884c7d65"),
        heads["order-23"]: BILLING_500.format(n=23, req="0a1b2c3d4e5f6071"),
        heads["order-31"]: SCHEMA,
        emails[0]: MAILER.format(addr="a@example.com"),
        emails[1]: MAILER.format(addr="b@"),
    }
    refused = await store.finalize([Decision.dead(m, errors[i]) for i, m in claimed.items() if i in errors])
    assert not refused
    # Only now the followers: committed after their heads, so behind them in commit order.
    behind = {
        "order-17": db.insert([("order-17", "OrderPaid", {"order": 17}), ("order-17", "OrderShipped", {"order": 17})]),
        "order-23": db.insert([("order-23", "OrderPaid", {"order": 23})]),
        "order-31": [],
    }
    beside = db.insert([(f"order-{n}", "OrderPlaced", {"order": n}) for n in (40, 41)])
    beside += db.insert([("cust-7", "EmailQueued", {"to": "c@example.com"})])
    # A running relay numbers committed ordered rows at its next claim (the ingest); one
    # claim of nothing does that here, so the followers have their aggregate_seq.
    await store.claim(owner="seed", batch=0, lease=timedelta(minutes=1), max_attempts=3)
    return Seeded(
        dead_heads=heads,
        behind=behind,
        billing=[heads["order-17"], heads["order-23"]],
        schema=[heads["order-31"]],
        mailer=list(emails),
        pending=[i for ids in behind.values() for i in ids] + beside,
        dead=len(errors),
    )


@pytest.fixture
async def seeded(make_store: Any, db: Db) -> tuple[OutboxStore, Seeded]:
    """:func:`seed` on the test's outbox, its ordering map stored first; the store it used."""
    store = await make_store(ORDERING)
    return store, await seed(store, db)


# ---- a console over the test's outbox, served on a real loopback port

TOKEN = "alice=" + "s3cret-token-" + "0123456789abcdef"
SECRET = TOKEN.split("=", 1)[1]


@dataclass
class RunningConsole:
    url: str  # http://127.0.0.1:PORT
    console: Console
    server: TestServer


@pytest.fixture
async def console_factory(
    relay_dsn: str, names: OutboxNames
) -> AsyncIterator[Callable[..., Awaitable[RunningConsole]]]:
    """``await console_factory(allow_actions=..., by=..., allowed_hosts=...)``: the console's
    app as `relay console` builds it (relay role, its own pool), on an aiohttp TestServer
    on 127.0.0.1 (``allowed_hosts``: as `relay console` bound there, unless given)."""
    started: list[tuple[TestServer, AsyncConnectionPool[Any], asyncio.Task[None]]] = []
    stop = asyncio.Event()

    async def start(
        *,
        allow_actions: bool = True,
        by: str | None = None,
        refresh_s: float = 2.0,
        allowed_hosts: frozenset[str] | None = frozenset(),
    ) -> RunningConsole:
        pool = await open_pool(relay_dsn, 2)
        config = ConsoleConfig(
            names=names,
            where=describe_dsn(relay_dsn),
            allow_actions=allow_actions,
            by=by,
            refresh_s=refresh_s,
            allowed_hosts=allowed_hosts,
        )
        history = History()
        console = Console(config, pool, history, Guard((parse_token(TOKEN),)))
        # Sampled five times a second (`relay console` allows 1 s at the least), so a test's
        # chart has points within a second or two.
        sampler = start_sampling(pool, names, history, timedelta(milliseconds=200), stop)
        server = TestServer(make_app(console), host="127.0.0.1")
        await server.start_server()
        started.append((server, pool, sampler))
        return RunningConsole(f"http://127.0.0.1:{server.port}", console, server)

    yield start
    stop.set()
    for server, pool, sampler in started:
        await server.close()
        await sampler
        await pool.close()
