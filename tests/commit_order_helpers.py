"""The commit-order oracle's checks and an in-process relay, shared by the tests that run
relays against an outbox and check what they delivered against what the producers
committed (tests/test_commit_order.py, tests/test_partitions.py)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg

from relay.config import CORE_OPTIONS, START_OPTIONS, RelaySettings
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.message import OutboxMessage
from relay.options import resolve
from relay.runner import run_relay
from relay.testing import InMemoryPublisher
from tests.producers import CommitLog, first_deliveries, order_violations


def relay_settings(pg_dsn: str, names: OutboxNames, **over: object) -> RelaySettings:
    values = resolve((*CORE_OPTIONS, *START_OPTIONS), {}, {}, {})
    values.update(
        dsn=pg_dsn,
        schema=names.schema,
        table=names.table,
        broker="log",
        workers=3,
        batch_size=20,
        poll_interval=timedelta(milliseconds=50),
        ordering_default="ordered",
        unordered=("Email*",),
    )
    values.update(over)
    return RelaySettings.from_values(values)


def seq_problems(delivered_first: list[OutboxMessage]) -> list[str]:
    """aggregate_seq must read 1, 2, 3, ... per aggregate in first-delivery order."""
    seen: dict[str, list[int | None]] = {}
    for m in delivered_first:
        if m.ordered:
            seen.setdefault(m.aggregate_id, []).append(m.aggregate_seq)
    return [f"{a}: {got}" for a, got in seen.items() if got != list(range(1, len(got) + 1))]


def assert_commit_order(log: CommitLog, publisher: InMemoryPublisher) -> None:
    first = [m for m in first_deliveries(publisher.delivered) if m.ordered]
    problems = order_violations(log.expected(), first)
    assert not problems, f"{len(problems)} aggregates out of commit order, e.g. {problems[:3]}"
    problems = seq_problems(first)
    assert not problems, f"aggregate_seq not 1, 2, 3, ...: {problems[:3]}"
    assert log.ids() <= {m.id for m in first}


class RelayInThread:
    """`run_relay` (3 workers, the in-memory broker) on an event loop of the test's own."""

    def __init__(self, settings: RelaySettings) -> None:
        self.publisher = InMemoryPublisher()
        self.settings = settings

    async def run_while(self, produce: Any, expected_ids: Any, timeout: float = 60) -> None:
        # The map first, as `relay migrate --ordered ...` would: rows are routed on insert.
        async with await psycopg.AsyncConnection.connect(self.settings.dsn, autocommit=True) as conn:
            await store_ordering(conn, self.settings.names, self.settings.ordering)
        stop = asyncio.Event()
        relay = asyncio.create_task(run_relay(self.settings, self.publisher, stop))
        try:
            await asyncio.to_thread(produce)
            deadline = asyncio.get_running_loop().time() + timeout
            while not expected_ids() <= set(self.publisher.delivered_ids()):
                assert asyncio.get_running_loop().time() < deadline, "not everything was delivered in time"
                assert not relay.done(), relay
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await relay
