"""The publisher conformance suite: the promises of :class:`relay.Publisher` checked the
same way against any destination, for real, on the destination itself.

Every built-in destination passes it (the project's ``tests/test_publisher_conformance.py``);
a destination of your own runs it in two steps. Write a :class:`Harness` that knows how to
start your publisher on a destination of the test's own and how to read back what arrived
there, then subclass :class:`PublisherConformance` in a test module and give it the
harness as a fixture::

    import pytest
    from relay.testing.conformance import Harness, PublisherConformance

    class TestMyDestination(PublisherConformance):
        @pytest.fixture
        def harness(self, my_broker) -> Harness:
            return MyHarness(my_broker)

Each case is a coroutine marked for pytest-asyncio (install ``outbox-relay[testing]``).
What your destination cannot be tested for (it refuses no message, it has no destination
that could be missing), the harness declares in :attr:`Harness.UNSUPPORTED` with the
reason, and the case skips saying so. Failure classes are expected from what the
destination really refuses, never from a mocked SDK.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import pytest
import pytest_asyncio

from relay.contract import DestinationState, Outcome, Publisher, check_destinations
from relay.errors import BrokerUnavailable, PermanentError, RetryableError
from relay.message import OutboxMessage

__all__ = ["ARRIVAL_TIMEOUT_S", "CASES", "Case", "Delivered", "Harness", "PublisherConformance"]

# The suite's cases a destination may be unable to take part in.
Case = Literal["permanent_failure", "missing_destination"]
CASES: tuple[Case, ...] = ("permanent_failure", "missing_destination")

# How long a harness's read waits for the messages a test expects; confirmed messages are
# already at the destination, so this is only ever spent when something is missing.
ARRIVAL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Delivered:
    """One message as its consumer got it: the envelope (header or attribute values typed
    back as ``OutboxMessage.envelope()`` types them: integers as ``int``) and the body as it
    arrived (bytes: a hostile payload, 10,000 arrays deep, is compared undecoded)."""

    envelope: dict[str, str | int]
    body: bytes

    @property
    def payload(self) -> Any:
        """The body decoded from JSON."""
        return json.loads(self.body)

    @property
    def outbox_id(self) -> int:
        """The envelope's ``outbox_id``."""
        return int(self.envelope["outbox_id"])


class Harness(ABC):
    """One destination, as the conformance suite drives it: how to start its publisher,
    and how a consumer of the test's own destination sees what arrived.

    Implement :meth:`start_publisher` and :meth:`read_delivered`; for the cases your
    destination can take part in, :meth:`start_missing_destination` and :meth:`refuse`.
    The suite calls :meth:`make_publisher` and :meth:`make_missing_destination`, which
    close every publisher they made after the test (:meth:`cleanup`).
    """

    # Envelope fields this wire does not carry (SQS and SNS leave out attempt and lease_version).
    LEFT_OUT: ClassVar[frozenset[str]] = frozenset()
    # Kinds of message the destination refuses for good (see refuse); empty when it refuses none.
    REFUSALS: ClassVar[tuple[str, ...]] = ()
    # Cases this destination cannot be tested for, each with the reason the case skips.
    UNSUPPORTED: ClassVar[Mapping[Case, str]] = {}

    def __init__(self, name: str) -> None:
        """:param name: how skips and failures name the destination."""
        self.name = name
        self._opened: list[Publisher] = []

    @abstractmethod
    async def start_publisher(self) -> Publisher:
        """A started publisher on this test's destination; every call may make a new one
        (on the same destination)."""

    async def start_missing_destination(self) -> Publisher:
        """A started publisher whose destination does not exist (and never will in the
        test); its destination check (:class:`relay.ChecksDestinations`) must say MISSING."""
        raise NotImplementedError(f"{self.name} has no destination that could be missing")

    @abstractmethod
    async def read_delivered(self, expected: int) -> list[Delivered]:
        """Everything that arrived since the last read, in arrival order: wait until at
        least ``expected`` messages have (or :data:`ARRIVAL_TIMEOUT_S` passed), then a
        moment longer for any extra, so that a duplicate shows."""

    def refuse(self, kind: str, message: OutboxMessage) -> OutboxMessage:
        """``message`` changed so that the destination refuses it for good, the way
        ``kind`` (one of :attr:`REFUSALS`) says: over the adapter's size limit, a
        character the service does not accept."""
        raise NotImplementedError(f"{self.name} refuses no message")

    def require(self, case: Case) -> None:
        """Skip the calling test, saying why, when this destination cannot take part in ``case``."""
        reason = self.UNSUPPORTED.get(case)
        if reason is not None:
            pytest.skip(f"{self.name}: {reason}")

    async def make_publisher(self) -> Publisher:
        """:meth:`start_publisher`'s publisher, closed after the test."""
        return self._close_after_test(await self.start_publisher())

    async def make_missing_destination(self) -> Publisher:
        """:meth:`start_missing_destination`'s publisher, closed after the test."""
        return self._close_after_test(await self.start_missing_destination())

    async def cleanup(self) -> None:
        """Close every publisher made (closing twice is allowed by the contract)."""
        for publisher in self._opened:
            await publisher.close()

    def _close_after_test(self, publisher: Publisher) -> Publisher:
        self._opened.append(publisher)
        return publisher


_ids = itertools.count(1)
_EVENT_TYPES = ("OrderPlaced", "OrderPaid", "InvoiceSent")


def _message(aggregate_id: str, *, seq: int | None = None, n: int = 0) -> OutboxMessage:
    """A claimed row with a fresh id; ordered when it has an aggregate ``seq``. Attempts,
    lease versions, types and payloads vary with ``n`` so that no envelope field can be
    right by accident."""
    outbox_id = next(_ids)
    return OutboxMessage(
        id=outbox_id,
        aggregate_type=("order", "invoice")[n % 2],
        aggregate_id=aggregate_id,
        event_type=_EVENT_TYPES[n % len(_EVENT_TYPES)],
        body=json.dumps({"id": outbox_id, "n": n, "note": "café ☕"}).encode(),
        attempt=1 + n % 3,
        lease_version=10 + n,
        ordered=seq is not None,
        aggregate_seq=seq,
    )


def _batch_of(size: int, prefix: str, seq: int = 1) -> list[OutboxMessage]:
    """A batch as a claim makes one: every other message ordered, at most one per aggregate,
    the rest unordered, two of them on one aggregate (one an id no broker may mangle)."""
    batch = []
    for n in range(size):
        if n % 2 == 0:
            batch.append(_message(f"{prefix}-ordered-{n}", seq=seq + n, n=n))
        else:
            batch.append(_message(f"{prefix}-commande n° {n % 4}", n=n))
    return batch


def _refuse_at(harness: Harness, batch: list[OutboxMessage], positions: Sequence[int], first_kind: int = 0) -> set[int]:
    """Make the messages at ``positions`` ones the destination refuses, cycling through its
    kinds of refusal; returns their ids (none for a destination that refuses nothing)."""
    refused: set[int] = set()
    if not harness.REFUSALS:
        return refused
    for k, i in enumerate(positions):
        kind = harness.REFUSALS[(first_kind + k) % len(harness.REFUSALS)]
        batch[i] = harness.refuse(kind, batch[i])
        refused.add(batch[i].id)
    return refused


def _kinds(outcomes: Sequence[Outcome]) -> list[str]:
    return ["ok" if o is None else type(o).__name__ for o in outcomes]


def _assert_arrived_once(
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


class PublisherConformance:
    """The suite, as test methods: subclass it in a test module (as ``TestSomething``) and
    define the ``harness`` fixture, returning your :class:`Harness` (parametrize it to run
    several destinations or flavours through the suite)."""

    @pytest.fixture
    def harness(self) -> Harness:
        """Yours to define in the subclass."""
        raise NotImplementedError("define the harness fixture in your PublisherConformance subclass")

    @pytest_asyncio.fixture
    async def target(self, harness: Harness) -> AsyncIterator[Harness]:
        """The harness, its publishers closed after the test."""
        yield harness
        await harness.cleanup()

    @pytest.mark.asyncio
    async def test_one_outcome_per_message_in_order(self, target: Harness) -> None:
        publisher = await target.make_publisher()
        sent: list[OutboxMessage] = []
        for size in (1, 2, 10, 23):
            batch = _batch_of(size, f"b{size}")
            # Refusals (where the destination has any) at the edges and in the middle show
            # that each outcome belongs to the message at its position.
            refused = _refuse_at(target, batch, sorted({0, size // 2, size - 1}) if size > 2 else [])
            outcomes = await publisher.publish(batch)
            expected = ["PermanentError" if m.id in refused else "ok" for m in batch]
            assert _kinds(outcomes) == expected
            sent += [m for m in batch if m.id not in refused]
        _assert_arrived_once(await target.read_delivered(len(sent)), sent, target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_a_confirmed_message_arrives_once_with_every_envelope_field(self, target: Harness) -> None:
        publisher = await target.make_publisher()
        batch = _batch_of(12, "env")
        assert {m.ordered for m in batch} == {True, False}  # aggregate_seq on the ordered ones only
        assert list(await publisher.publish(batch)) == [None] * 12
        _assert_arrived_once(await target.read_delivered(12), batch, target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_producer_headers_arrive_beside_the_relays_and_trace_context_unchanged(self, target: Harness) -> None:
        # Producers' own headers (the headers column): W3C trace context passes through as
        # written. Three headers fill an ordered message's AWS attributes to their limit of 10.
        publisher = await target.make_publisher()
        headers = {
            "tenant": "t-1",
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tracestate": "vendor=opaque,other=x",
        }
        batch = [replace(m, headers=dict(headers)) for m in _batch_of(4, "hdr")]
        assert list(await publisher.publish(batch)) == [None] * 4
        delivered = await target.read_delivered(4)
        _assert_arrived_once(delivered, batch, target.LEFT_OUT)
        assert all(d.envelope["traceparent"] == headers["traceparent"] for d in delivered)

    @pytest.mark.asyncio
    async def test_a_permanent_failure_leaves_its_neighbours_retryable_or_delivered(self, target: Harness) -> None:
        target.require("permanent_failure")
        publisher = await target.make_publisher()
        neighbours: dict[int, OutboxMessage] = {}  # by id, as last sent
        for k, kind in enumerate(target.REFUSALS):
            batch = _batch_of(5, f"perm{k}")
            batch[2] = bad = target.refuse(kind, batch[2])
            outcomes = await publisher.publish(batch)
            assert isinstance(outcomes[2], PermanentError), (kind, _kinds(outcomes))
            others = [o for i, o in enumerate(outcomes) if i != 2]
            assert all(o is None or isinstance(o, RetryableError) for o in others), (kind, _kinds(outcomes))
            # The retryable go again, as the relay would send them, until delivered.
            pending = [m for m, o in zip(batch, outcomes, strict=True) if isinstance(o, RetryableError)]
            neighbours.update((m.id, m) for m in batch if m is not bad)
            for _ in range(3):
                if not pending:
                    break
                pending = [replace(m, attempt=m.attempt + 1) for m in pending]
                neighbours.update((m.id, m) for m in pending)
                again = await publisher.publish(pending)
                assert all(o is None or isinstance(o, RetryableError) for o in again), (kind, _kinds(again))
                pending = [m for m, o in zip(pending, again, strict=True) if o is not None]
            assert not pending, f"{kind}: neighbours still not delivered after three retries"
        # Every neighbour arrived once; no refused message did.
        _assert_arrived_once(await target.read_delivered(len(neighbours)), list(neighbours.values()), target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_a_missing_destination_is_broker_unavailable_for_its_messages_only(self, target: Harness) -> None:
        target.require("missing_destination")
        missing = await target.make_missing_destination()
        working = await target.make_publisher()
        lost, delivered = _batch_of(12, "lost"), _batch_of(12, "kept")
        # One publisher has one destination, so every message of its batch is refused;
        # another publisher of the same destination type delivers meanwhile.
        refused, confirmed = await asyncio.gather(missing.publish(lost), working.publish(delivered))
        assert _kinds(refused) == ["BrokerUnavailable"] * 12
        assert list(confirmed) == [None] * 12
        # Still missing: still refused, whole batch, not retried or sent to dead.
        again = await missing.publish(_batch_of(3, "lost-again"))
        assert _kinds(again) == ["BrokerUnavailable"] * 3
        assert all(isinstance(o, BrokerUnavailable) for o in [*refused, *again])
        _assert_arrived_once(await target.read_delivered(12), delivered, target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_the_destination_check_tells_a_missing_destination_from_one_that_is_there(
        self, target: Harness
    ) -> None:
        target.require("missing_destination")
        missing = await target.make_missing_destination()
        working = await target.make_publisher()
        # Before any publish: relay start looks before it reports ready.
        absent, there = await asyncio.gather(check_destinations(missing), check_destinations(working))
        assert absent is not None and there is not None, "a destination that can be missing can be looked at"
        assert [c.state for c in absent] == [DestinationState.MISSING], absent
        assert [c.state for c in there] == [DestinationState.EXISTS], there
        assert absent[0].reason and absent[0].destination != there[0].destination

    @pytest.mark.asyncio
    async def test_close_after_publish_loses_nothing(self, target: Harness) -> None:
        publisher = await target.make_publisher()
        batches = [_batch_of(10, f"close{w}") for w in range(3)]
        results = await asyncio.gather(*(publisher.publish(b) for b in batches))
        assert [list(r) for r in results] == [[None] * 10] * 3
        await publisher.close()
        _assert_arrived_once(await target.read_delivered(30), [m for b in batches for m in b], target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_concurrent_publishes_from_several_workers(self, target: Harness) -> None:
        workers, rounds, size = 4, 3, 15
        publisher = await target.make_publisher()

        async def worker(w: int) -> list[tuple[list[OutboxMessage], set[int], Sequence[Outcome]]]:
            done = []
            for r in range(rounds):
                # One worker's ordered aggregates move on one message per round, as their heads do.
                batch = _batch_of(size, f"w{w}", seq=1 + r * size)
                refused = _refuse_at(target, batch, [(w * rounds + r) % size], first_kind=w + r)
                done.append((batch, refused, await publisher.publish(batch)))
            return done

        results = await asyncio.gather(*(worker(w) for w in range(workers)))
        sent: list[OutboxMessage] = []
        for batch, refused, outcomes in itertools.chain.from_iterable(results):
            # Each call got its own batch's outcomes, in its order, whatever ran beside it.
            assert _kinds(outcomes) == ["PermanentError" if m.id in refused else "ok" for m in batch]
            sent += [m for m in batch if m.id not in refused]
        _assert_arrived_once(await target.read_delivered(len(sent)), sent, target.LEFT_OUT)

    @pytest.mark.asyncio
    async def test_an_empty_batch_returns_no_outcomes(self, target: Harness) -> None:
        publisher = await target.make_publisher()
        assert list(await publisher.publish([])) == []
        assert await target.read_delivered(0) == []
