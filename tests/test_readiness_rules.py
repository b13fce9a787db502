"""relay.readiness on its own, without a broker: which reason /readyz gives first, and how
the destination checks are followed (logged once, checked again until there)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from relay.breaker import CircuitBreaker
from relay.contract import DestinationCheck, DestinationState
from relay.readiness import Destinations, not_ready
from relay.testing import InMemoryPublisher


class LookingPublisher(InMemoryPublisher):
    """A publisher whose destinations are what the test says (for relay.readiness alone)."""

    def __init__(self, *checks: DestinationCheck) -> None:
        super().__init__()
        self.checks = list(checks)
        self.held: list[str] = []
        self.looks = 0

    async def check_destinations(self) -> list[DestinationCheck]:
        self.looks += 1
        return list(self.checks)

    def unroutable(self) -> list[str]:
        return self.held


async def test_readiness_names_the_first_reason_and_follows_the_checks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="relay.readiness")
    orders = DestinationCheck("exchange 'orders'", DestinationState.MISSING, "NOT_FOUND - no exchange 'orders'")
    peek = DestinationCheck("SQS queue q", DestinationState.DENIED, "AccessDenied")
    publisher = LookingPublisher(orders, peek)
    destinations = Destinations(publisher)
    breaker = CircuitBreaker()
    await destinations.check()
    assert not_ready(breaker, destinations) == "destination exchange 'orders' missing: NOT_FOUND - no exchange 'orders'"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "/readyz answers 503 until it is there" in errors[0]
    assert any("cannot look at destination SQS queue q" in r.getMessage() for r in caplog.records)

    # The broker refusing everything comes first; then the missing destination again.
    breaker.record(unavailable=True, reason="BrokerUnavailable: blocked: memory")
    assert not_ready(breaker, destinations) == "broker: BrokerUnavailable: blocked: memory"
    breaker.record(unavailable=False)

    # Checked again on the probes' schedule until it is there; said once more, then ready.
    publisher.checks[0] = DestinationCheck("exchange 'orders'", DestinationState.EXISTS)
    stop = asyncio.Event()
    await asyncio.wait_for(destinations.watch(stop), timeout=2)  # the first recheck is 0.5 s away at most
    assert publisher.looks == 2 and not_ready(breaker, destinations) is None  # denied does not count against
    assert any("destination exchange 'orders' is there now" in r.getMessage() for r in caplog.records)

    # A route's destination paused, then held routing keys (several: counted, not all named).
    destinations.destination_changed("invoices", True)
    assert not_ready(breaker, destinations) == "destination invoices paused: it refused every message"
    destinations.destination_changed("invoices", False)
    publisher.held = [f"exchange '' routing key 'k{i}'" for i in range(5)]
    assert not_ready(breaker, destinations) == (
        "unroutable: exchange '' routing key 'k0', exchange '' routing key 'k1', exchange '' routing key 'k2'"
        " reach no queue; their messages wait (and 2 more)"
    )
