"""One publisher over several destinations: each message goes to its route's publisher,
and each destination keeps its own health.

A destination that refuses every message (a missing queue, topic or exchange, access
denied on it) pauses alone: its messages come back :class:`relay.errors.DestinationUnavailable`
(attempt refunded, never 'dead') without another call to the broker until its next probe,
0.5 s to 5 s apart as the process breaker's, while the other destinations flow and the
workers keep claiming. An ordered aggregate whose head waits for a paused destination
waits as a whole, since nothing behind its head is claimed. A destination that takes the
messages of some routing keys and not others (RabbitMQ: no queue bound for a key) holds
those keys alone, in its adapter, and is not paused. A message with no destination
at all (no route takes its type and no default destination is set) waits the same way,
with one error line per event type, until a relay with a route for it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from relay.backoff import Backoff
from relay.contract import ChecksDestinations, DestinationCheck, Outcome, Publisher, ReportsUnroutable
from relay.errors import BrokerUnavailable, DestinationUnavailable, first_line
from relay.message import OutboxMessage
from relay.routes import MAX_REMEMBERED, NO_DESTINATION, Router

log = logging.getLogger("relay.routing")

# How long a message with no destination waits before it is claimed again: another relay
# with a route for it (or this one, restarted with one) takes it by then.
NO_DESTINATION_RETRY = timedelta(seconds=5)


class DestinationHealth:
    """Whether one destination takes messages; open after a batch it refused whole, with
    probes (one message) backing off from 0.5 s to 5 s until one is taken."""

    def __init__(
        self,
        name: str,
        *,
        backoff: Backoff | None = None,
        on_change: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.backoff = backoff or Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=5))
        self.on_change = on_change
        self._clock = clock
        self.failures = 0
        self._next_probe = 0.0
        self._opened_at = 0.0
        self._probing = False

    @property
    def is_open(self) -> bool:
        return self.failures > 0

    def retry_after(self) -> timedelta:
        """When the messages this destination refused are worth claiming again."""
        return timedelta(seconds=self.backoff.ceiling(max(1, self.failures)))

    def take_probe(self) -> bool:
        """While open: True for the one caller allowed to send a probe now."""
        if self._probing or self._clock() < self._next_probe:
            return False
        self._probing = True
        return True

    def record(self, *, refused: bool, reason: str = "") -> None:
        self._probing = False
        if refused:
            self.failures += 1
            self._next_probe = self._clock() + self.retry_after().total_seconds()
            if self.failures == 1:
                self._opened_at = self._clock()
                log.warning("destination %s unavailable, its messages wait and it is probed: %s", self.name, reason)
                if self.on_change:
                    self.on_change(self.name, True)
        elif self.failures:
            log.info("destination %s is back after %.1fs", self.name, self._clock() - self._opened_at)
            self.failures = 0
            if self.on_change:
                self.on_change(self.name, False)


class RoutedPublisher:
    """Implements :class:`relay.contract.Publisher` over one publisher per route (and one
    for the default destination, if set), each with its :class:`DestinationHealth`."""

    name = "routed"

    def __init__(
        self,
        router: Router,
        publishers: Sequence[Publisher],
        default: Publisher | None,
        *,
        default_name: str = "default",
        on_change: Callable[[str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """:param publishers: one per route of ``router``, in its order.
        :param default: the default destination's publisher; None when there is none."""
        if len(publishers) != len(router.routes):
            raise ValueError("one publisher per route")
        self.router = router
        self._targets: dict[int, tuple[Publisher, DestinationHealth]] = {
            i: (p, DestinationHealth(route.destination, on_change=on_change, clock=clock))
            for i, (route, p) in enumerate(zip(router.routes, publishers, strict=True))
        }
        if default is not None:
            self._targets[-1] = (default, DestinationHealth(default_name, on_change=on_change, clock=clock))
        self._unrouted_said: set[str] = set()

    def watch_destinations(self, on_change: Callable[[str, bool], None]) -> None:
        """Report every destination's breaker opening and closing (the metrics' label)."""
        for _, health in self._targets.values():
            health.on_change = on_change
            on_change(health.name, health.is_open)

    def health(self, route: int) -> DestinationHealth:
        return self._targets[route][1]

    def paused(self) -> list[str]:
        """The destinations paused now (for /readyz)."""
        return [health.name for _, health in self._targets.values() if health.is_open]

    def unroutable(self) -> list[str]:
        """Every destination's held routing keys (:class:`relay.contract.ReportsUnroutable`)."""
        return [key for p, _ in self._targets.values() if isinstance(p, ReportsUnroutable) for key in p.unroutable()]

    async def check_destinations(self) -> list[DestinationCheck]:
        """Every route's destination and the default one, looked at concurrently, each
        named once (:class:`relay.contract.ChecksDestinations`)."""
        checking = [p.check_destinations() for p, _ in self._targets.values() if isinstance(p, ChecksDestinations)]
        found: dict[str, DestinationCheck] = {}
        for checks in await asyncio.gather(*checking):
            for check in checks:
                found.setdefault(check.destination, check)
        return list(found.values())

    async def start(self) -> None:
        for publisher, _ in self._targets.values():
            await publisher.start()

    async def close(self) -> None:
        for publisher, _ in self._targets.values():
            await publisher.close()

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        outcomes: list[Outcome] = [None] * len(batch)
        groups: dict[int | None, list[int]] = {}
        for i, m in enumerate(batch):
            groups.setdefault(self.router.route_of(m.event_type), []).append(i)
        sends = []
        for route, indices in groups.items():
            if route is None:
                for i in indices:
                    outcomes[i] = self._no_destination(batch[i].event_type)
            else:
                sends.append(self._send(route, [batch[i] for i in indices], indices, outcomes))
        await asyncio.gather(*sends)
        return outcomes

    async def _send(
        self, route: int, messages: list[OutboxMessage], indices: list[int], outcomes: list[Outcome]
    ) -> None:
        publisher, health = self._targets[route]
        if health.is_open:
            # Paused: one message probes, when its turn has come; the rest wait unsent.
            count = 1 if health.take_probe() else 0
            for i in indices[count:]:
                outcomes[i] = self._paused(health)
            messages, indices = messages[:count], indices[:count]
            if not messages:
                return
        try:
            got = list(await publisher.publish(messages))
        except asyncio.CancelledError:
            health.record(refused=health.is_open, reason="publish cut off")
            raise
        except Exception as exc:  # the contract: taken as every message's outcome
            got = [exc] * len(messages)
        # A DestinationUnavailable from the adapter holds one part of the destination (a
        # routing key no queue is bound for): the destination itself took the message.
        refused = [o for o in got if isinstance(o, BrokerUnavailable) and not isinstance(o, DestinationUnavailable)]
        if len(refused) == len(got):
            health.record(refused=True, reason=first_line(refused[0]))
        elif any(o is None for o in got) or health.is_open:
            health.record(refused=False)
        for i, outcome in zip(indices, got, strict=True):
            if isinstance(outcome, BrokerUnavailable) and not isinstance(outcome, DestinationUnavailable):
                outcome = DestinationUnavailable(
                    str(outcome), destination=health.name, retry_after=health.retry_after()
                )
            outcomes[i] = outcome

    def _paused(self, health: DestinationHealth) -> DestinationUnavailable:
        return DestinationUnavailable(
            f"destination {health.name} is paused after refusing every message; waiting for it, no attempt spent",
            destination=health.name,
            retry_after=health.retry_after(),
        )

    def _no_destination(self, event_type: str) -> DestinationUnavailable:
        if event_type not in self._unrouted_said:
            if len(self._unrouted_said) >= MAX_REMEMBERED:  # a new type per message: say it again later
                self._unrouted_said.clear()
            self._unrouted_said.add(event_type)
            log.error(
                "no destination for event type %r: no route takes it and no default destination is set;"
                " its messages wait (no attempt spent) until a relay with a route for it runs",
                event_type,
            )
        return DestinationUnavailable(
            f"no destination for event type {event_type!r}: no route takes it and no default destination is set",
            destination=NO_DESTINATION,
            retry_after=NO_DESTINATION_RETRY,
        )
