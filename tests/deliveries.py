"""What a fleet of relays delivered to RabbitMQ, read in arrival order, and the check of
it against the producers' own oracle (tests.producers): every id delivered, ordered
messages in commit order with aggregate_seq 1, 2, 3, ..., nothing dead but the poisoned.
Shared by the fault suite and the pipelining tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aio_pika

from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.producers import count_inversions, first_deliveries, order_violations
from tests.rabbitmq_broker import AmqpService, unique
from tests.relay_process import run_relay

# The event types the fleets deliver in order (the rest unordered).
ORDERED = "Order*"


def store_fleet_ordering(pg_dsn: str, names: OutboxNames) -> None:
    """The fleet's ordering map, stored before any relay starts (as the README says to), so
    rows producers write before the first relay is up are routed by it too."""
    proc = run_relay(
        "migrate", "--dsn", pg_dsn, "--schema", names.schema, "--ordering-default", "unordered", "--ordered", ORDERED
    )
    assert proc.returncode == 0, proc.stderr


@dataclass(frozen=True)
class Delivery:
    outbox_id: int
    aggregate_id: str
    event_type: str
    lease_version: int | None  # None where the broker's message no longer carries it (SQS, SNS since 0015)
    aggregate_seq: int | None
    received_at: float = 0.0  # time.monotonic() when the consumer got it


class QueueReader:
    """A consumer on ``queue`` that records every delivery, in arrival order, while the
    test goes on."""

    def __init__(self, amqp: AmqpService, queue: str) -> None:
        self.amqp = amqp
        self.queue = queue
        self.got: list[Delivery] = []
        self.changed = asyncio.Event()
        self._connection: Any = None

    async def __aenter__(self) -> QueueReader:
        self._connection = await aio_pika.connect_robust(
            self.amqp.url, client_properties={"connection_name": unique("consumer")}
        )
        channel = await self._connection.channel()
        await channel.set_qos(prefetch_count=500)
        q = await channel.get_queue(self.queue, ensure=False)
        await q.consume(self._on_message)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._connection.close()

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        h = message.headers
        seq = h.get("aggregate_seq")
        self.got.append(
            Delivery(
                int(str(h["outbox_id"])),
                str(h["aggregate_id"]),
                str(h["event_type"]),
                int(str(h["lease_version"])),
                int(str(seq)) if seq is not None else None,
                time.monotonic(),
            )
        )
        await message.ack()
        self.changed.set()

    async def wait_for(self, ids: set[int], timeout: float) -> None:
        """Until every id in ``ids`` has arrived, or ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not ids <= {d.outbox_id for d in self.got} and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))


async def read_queue(amqp: AmqpService, queue: str, expected_ids: set[int], timeout: float = 60) -> list[Delivery]:
    """Everything on ``queue`` in arrival order, until every expected id has arrived."""
    async with QueueReader(amqp, queue) as reader:
        await reader.wait_for(expected_ids, timeout)
        await asyncio.sleep(0.5)  # let duplicates still in the queue arrive too
    return reader.got


def check_deliveries(
    db: Db,
    deliveries: list[Delivery],
    expected: dict[str, list[int]],
    *,
    poisoned: frozenset[int] = frozenset(),
) -> Counter[int]:
    """Everything delivered, ordered messages in commit order with aggregate_seq 1, 2, 3,
    ..., nothing dead but the poisoned; returns the duplicates."""
    ids = {r["id"] for r in db.rows()}
    delivered = Counter(d.outbox_id for d in deliveries)
    missing = ids - set(delivered) - poisoned
    assert not missing, f"{len(missing)} outbox ids never delivered, e.g. {sorted(missing)[:5]}"
    first = first_deliveries(deliveries)
    wanted = {a: [i for i in order if i not in poisoned] for a, order in expected.items()}
    inversions = count_inversions(wanted, first)
    problems = order_violations(wanted, first)
    assert not problems, f"{inversions} events delivered after a later one of their aggregate; e.g. {problems[:2]}"
    blocked = {r["aggregate_id"] for r in db.rows() if r["id"] in poisoned}
    seqs: dict[str, list[int | None]] = {}
    for d in first:
        if d.aggregate_seq is not None and d.aggregate_id not in blocked:
            seqs.setdefault(d.aggregate_id, []).append(d.aggregate_seq)
    gaps = [f"{a}: {got[:10]}" for a, got in seqs.items() if got != list(range(1, len(got) + 1))]
    assert not gaps, f"aggregate_seq not 1, 2, 3, ... in delivery order: {gaps[:3]}"
    number = {d.outbox_id: d.aggregate_seq for d in first}
    renumbered = [d.outbox_id for d in deliveries if d.aggregate_seq != number[d.outbox_id]]
    assert not renumbered, f"a duplicate carried another aggregate_seq: {renumbered[:5]}"
    ordered_ids = {i for order in expected.values() for i in order}
    assert all((d.aggregate_seq is not None) == (d.outbox_id in ordered_ids) for d in first), (
        "aggregate_seq on an unordered message, or missing on an ordered one"
    )
    dead = {r["id"] for r in db.rows() if r["status"] == "dead"}
    assert dead == set(poisoned), f"unexpected dead rows: {sorted(dead - set(poisoned))[:5]}"
    duplicates = Counter({i: n - 1 for i, n in delivered.items() if n > 1})
    print(
        f"\n  delivered {len(delivered)} ids ({len(ordered_ids)} ordered, 0 out of commit order),"
        f" {sum(duplicates.values())} duplicate deliveries of {len(duplicates)} ids"
    )
    return duplicates
