"""One contract, every adapter: the promises of ``relay.contract.Publisher`` checked the
same way against each broker for real (RabbitMQ, SQS standard and FIFO on moto in server
mode) and against the in-memory and log publishers.

Each case runs once per entry of ``tests.publisher_targets.TARGETS``; an adapter that
cannot take part in a case declares why, and the case skips with that reason (a skip is
not a pass: ``test_every_case_runs_on_at_least_two_real_brokers`` keeps each case on two
real brokers at least). Failure classes are produced by what the brokers really refuse,
never by mocking an SDK; the adapters' own suites test every failure class one by one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import pytest

from relay.contract import DestinationState, Outcome, Publisher, check_destinations
from relay.errors import BrokerUnavailable, PermanentError, RetryableError
from relay.message import OutboxMessage
from tests.publisher_targets import CASES, TARGETS, Delivered, Target, TargetSpec

_ids = itertools.count(1)
EVENT_TYPES = ("OrderPlaced", "OrderPaid", "InvoiceSent")


@pytest.fixture(params=TARGETS, ids=[spec.name for spec in TARGETS])
def harness(request: pytest.FixtureRequest) -> Target:
    """The harness, built from the fixtures it names (only those: memory and log need no
    broker). Synchronous, because an async fixture cannot request fixtures lazily."""
    spec: TargetSpec = request.param
    return spec.build({name: request.getfixturevalue(name) for name in spec.kind.FIXTURES})


@pytest.fixture
async def target(harness: Target) -> AsyncIterator[Target]:
    yield harness
    await harness.cleanup()


def message(aggregate_id: str, *, seq: int | None = None, n: int = 0) -> OutboxMessage:
    """A claimed row with a fresh id; ordered when it has an aggregate ``seq``. Attempts,
    lease versions, types and payloads vary with ``n`` so that no envelope field can be
    right by accident."""
    outbox_id = next(_ids)
    return OutboxMessage(
        id=outbox_id,
        aggregate_type=("order", "invoice")[n % 2],
        aggregate_id=aggregate_id,
        event_type=EVENT_TYPES[n % len(EVENT_TYPES)],
        body=json.dumps({"id": outbox_id, "n": n, "note": "café ☕"}).encode(),
        attempt=1 + n % 3,
        lease_version=10 + n,
        ordered=seq is not None,
        aggregate_seq=seq,
    )


def batch_of(size: int, prefix: str, seq: int = 1) -> list[OutboxMessage]:
    """A batch as a claim makes one: every other message ordered, at most one per aggregate,
    the rest unordered, two of them on one aggregate (one an id no broker may mangle)."""
    batch = []
    for n in range(size):
        if n % 2 == 0:
            batch.append(message(f"{prefix}-ordered-{n}", seq=seq + n, n=n))
        else:
            batch.append(message(f"{prefix}-commande n° {n % 4}", n=n))
    return batch


def refuse_at(target: Target, batch: list[OutboxMessage], positions: Sequence[int], first_kind: int = 0) -> set[int]:
    """Make the messages at ``positions`` ones the broker refuses, cycling through its
    kinds of refusal; returns their ids (none for a broker that refuses nothing)."""
    refused: set[int] = set()
    if not target.REFUSALS:
        return refused
    for k, i in enumerate(positions):
        kind = target.REFUSALS[(first_kind + k) % len(target.REFUSALS)]
        batch[i] = target.refuse(kind, batch[i])
        refused.add(batch[i].id)
    return refused


def kinds(outcomes: Sequence[Outcome]) -> list[str]:
    return ["ok" if o is None else type(o).__name__ for o in outcomes]


def assert_arrived_once(
    delivered: list[Delivered], sent: Sequence[OutboxMessage], left_out: frozenset[str] = frozenset()
) -> None:
    """Every message of ``sent`` arrived exactly once, with its whole envelope and its
    payload, and nothing else arrived."""
    assert sorted(d.outbox_id for d in delivered) == sorted(m.id for m in sent)
    by_id = {d.outbox_id: d for d in delivered}
    for m in sent:
        got = by_id[m.id]
        assert got.envelope == {k: v for k, v in m.envelope().items() if k not in left_out}, (m.id, got.envelope)
        assert got.payload == m.payload()


async def test_one_outcome_per_message_in_order(target: Target) -> None:
    publisher = await target.make_publisher()
    sent: list[OutboxMessage] = []
    for size in (1, 2, 10, 23):
        batch = batch_of(size, f"b{size}")
        # Refusals (where the broker has any) at the edges and in the middle show that
        # each outcome belongs to the message at its position.
        refused = refuse_at(target, batch, sorted({0, size // 2, size - 1}) if size > 2 else [])
        outcomes = await publisher.publish(batch)
        expected = ["PermanentError" if m.id in refused else "ok" for m in batch]
        assert kinds(outcomes) == expected
        sent += [m for m in batch if m.id not in refused]
    assert_arrived_once(await target.read_delivered(len(sent)), sent, target.LEFT_OUT)


async def test_a_confirmed_message_arrives_once_with_every_envelope_field(target: Target) -> None:
    publisher = await target.make_publisher()
    batch = batch_of(12, "env")
    assert {m.ordered for m in batch} == {True, False}  # aggregate_seq on the ordered ones only
    assert list(await publisher.publish(batch)) == [None] * 12
    assert_arrived_once(await target.read_delivered(12), batch, target.LEFT_OUT)


async def test_producer_headers_arrive_beside_the_relays_and_trace_context_unchanged(target: Target) -> None:
    # Producers' own headers (the headers column): each an AMQP header or SQS/SNS message
    # attribute; W3C trace context passes through as written. Three headers fill an ordered
    # message's AWS attributes to their limit of 10.
    publisher = await target.make_publisher()
    headers = {
        "tenant": "t-1",
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "vendor=opaque,other=x",
    }
    batch = [replace(m, headers=dict(headers)) for m in batch_of(4, "hdr")]
    assert list(await publisher.publish(batch)) == [None] * 4
    delivered = await target.read_delivered(4)
    assert_arrived_once(delivered, batch, target.LEFT_OUT)
    assert all(d.envelope["traceparent"] == headers["traceparent"] for d in delivered)


async def test_a_permanent_failure_leaves_its_neighbours_retryable_or_delivered(target: Target) -> None:
    target.require("permanent_failure")
    publisher = await target.make_publisher()
    neighbours: dict[int, OutboxMessage] = {}  # by id, as last sent
    for k, kind in enumerate(target.REFUSALS):
        batch = batch_of(5, f"perm{k}")
        batch[2] = bad = target.refuse(kind, batch[2])
        outcomes = await publisher.publish(batch)
        assert isinstance(outcomes[2], PermanentError), (kind, kinds(outcomes))
        others = [o for i, o in enumerate(outcomes) if i != 2]
        assert all(o is None or isinstance(o, RetryableError) for o in others), (kind, kinds(outcomes))
        # The retryable go again, as the relay would send them, until delivered.
        pending = [m for m, o in zip(batch, outcomes, strict=True) if isinstance(o, RetryableError)]
        neighbours.update((m.id, m) for m in batch if m is not bad)
        for _ in range(3):
            if not pending:
                break
            pending = [replace(m, attempt=m.attempt + 1) for m in pending]
            neighbours.update((m.id, m) for m in pending)
            again = await publisher.publish(pending)
            assert all(o is None or isinstance(o, RetryableError) for o in again), (kind, kinds(again))
            pending = [m for m, o in zip(pending, again, strict=True) if o is not None]
        assert not pending, f"{kind}: neighbours still not delivered after three retries"
    # Every neighbour arrived once; no refused message did.
    assert_arrived_once(await target.read_delivered(len(neighbours)), list(neighbours.values()), target.LEFT_OUT)


async def test_a_missing_destination_is_broker_unavailable_for_its_messages_only(target: Target) -> None:
    target.require("missing_destination")
    missing = await target.make_missing_destination()
    working = await target.make_publisher()
    lost, delivered = batch_of(12, "lost"), batch_of(12, "kept")
    # One adapter instance has one destination, so every message of its batch is refused;
    # another instance of the same broker delivers meanwhile.
    refused, confirmed = await asyncio.gather(missing.publish(lost), working.publish(delivered))
    assert kinds(refused) == ["BrokerUnavailable"] * 12
    assert list(confirmed) == [None] * 12
    # Still missing: still refused, whole batch, not retried or sent to dead.
    again = await missing.publish(batch_of(3, "lost-again"))
    assert kinds(again) == ["BrokerUnavailable"] * 3
    assert all(isinstance(o, BrokerUnavailable) for o in [*refused, *again])
    assert_arrived_once(await target.read_delivered(12), delivered, target.LEFT_OUT)


async def test_the_destination_check_tells_a_missing_destination_from_one_that_is_there(target: Target) -> None:
    target.require("missing_destination")
    missing = await target.make_missing_destination()
    working = await target.make_publisher()
    # Before any publish: relay start looks before it reports ready (relay.contract).
    absent, there = await asyncio.gather(check_destinations(missing), check_destinations(working))
    assert absent is not None and there is not None, "an adapter with a destination can look at it"
    assert [c.state for c in absent] == [DestinationState.MISSING], absent
    assert [c.state for c in there] == [DestinationState.EXISTS], there
    assert absent[0].reason and absent[0].destination != there[0].destination


async def test_close_after_publish_loses_nothing(target: Target) -> None:
    publisher = await target.make_publisher()
    batches = [batch_of(10, f"close{w}") for w in range(3)]
    results = await asyncio.gather(*(publisher.publish(b) for b in batches))
    assert [list(r) for r in results] == [[None] * 10] * 3
    await publisher.close()
    assert_arrived_once(await target.read_delivered(30), [m for b in batches for m in b], target.LEFT_OUT)


async def test_concurrent_publishes_from_several_workers(target: Target) -> None:
    workers, rounds, size = 4, 3, 15
    publisher = await target.make_publisher()

    async def worker(w: int) -> list[tuple[list[OutboxMessage], set[int], Sequence[Outcome]]]:
        done = []
        for r in range(rounds):
            # One worker's ordered aggregates move on one message per round, as their heads do.
            batch = batch_of(size, f"w{w}", seq=1 + r * size)
            refused = refuse_at(target, batch, [(w * rounds + r) % size], first_kind=w + r)
            done.append((batch, refused, await publisher.publish(batch)))
        return done

    results = await asyncio.gather(*(worker(w) for w in range(workers)))
    sent: list[OutboxMessage] = []
    for batch, refused, outcomes in itertools.chain.from_iterable(results):
        # Each call got its own batch's outcomes, in its order, whatever ran beside it.
        assert kinds(outcomes) == ["PermanentError" if m.id in refused else "ok" for m in batch]
        sent += [m for m in batch if m.id not in refused]
    assert_arrived_once(await target.read_delivered(len(sent)), sent, target.LEFT_OUT)


async def test_an_empty_batch_returns_no_outcomes(target: Target) -> None:
    publisher: Publisher = await target.make_publisher()
    assert list(await publisher.publish([])) == []
    assert await target.read_delivered(0) == []


def test_every_case_runs_on_at_least_two_real_brokers() -> None:
    """Skips are declared, with a reason, by the harness; none may leave a case covered by
    fewer than two real brokers, and a harness refuses messages exactly when it says it can."""
    for case in CASES:
        real = [spec.name for spec in TARGETS if spec.kind.REAL_BROKER and case not in spec.kind.UNSUPPORTED]
        assert len(real) >= 2, f"{case} runs on real brokers {real} only"
    for spec in TARGETS:
        assert bool(spec.kind.REFUSALS) == ("permanent_failure" not in spec.kind.UNSUPPORTED), spec.name
        assert all(reason.strip() for reason in spec.kind.UNSUPPORTED.values()), spec.name
        assert set(spec.kind.UNSUPPORTED) <= set(CASES), spec.name
