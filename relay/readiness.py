"""When `relay start` is ready: the one definition /readyz answers by.

A relay is ready while all of these hold, checked in this order, the first that fails
giving the reason of the 503 (docs/operations.md, "Readiness", says the same for operators):

1. **The database answers**: a zero-row read of the outbox through the relay's pool, within
   2 s (:func:`relay.httpd.pool_check`).
2. **The broker takes messages**: the process's circuit breaker is closed. It opens when the
   broker refuses a whole batch (unreachable, blocked by a resource alarm, a missing
   exchange or queue, access denied) and closes at the first probe it takes again.
3. **Every destination is there**: none that the start-up check (or a later one) found
   missing or unreachable, and none of the routes' destinations paused
   (:mod:`relay.routing`). A destination found missing is checked again every 0.5 s to
   5 s, so a relay becomes ready within seconds of it being created, also with no message
   to send; one that the broker would not let us look at (access denied) does not count
   against readiness, since sending may be allowed where looking is not.
4. **No message is held as unroutable**: no routing key whose messages reach no queue
   (RabbitMQ's 312 NO_ROUTE; :class:`relay.contract.ReportsUnroutable`).

The outbox's contents play no part: a backlog, dead messages or blocked aggregates are the
metrics' and alerts' business, not a reason to take a relay out of service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta

from relay.backoff import Backoff
from relay.breaker import CircuitBreaker
from relay.claimcheck import ClaimCheckStore
from relay.contract import DestinationCheck, DestinationState, Publisher, ReportsUnroutable, check_destinations
from relay.errors import first_line
from relay.sleep import sleep_unless_stopped

log = logging.getLogger("relay.readiness")

# A destination found missing is looked at again this often: the routes' and the breaker's
# probe schedule, so readiness follows delivery, which resumes on that schedule too.
RECHECK = Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=5))
# How many names one /readyz line lists before it says how many more there are.
SHOWN_NAMES = 3


class Destinations:
    """What the destination checks found, kept current; the routes' paused destinations."""

    def __init__(self, publisher: Publisher, claim_check: ClaimCheckStore | None = None) -> None:
        """``claim_check``: the claim-check's store, whose buckets are destinations too."""
        self.publisher = publisher
        self.claim_check = claim_check
        self.checks: dict[str, DestinationCheck] = {}
        self.paused: set[str] = set()
        self.checked = False  # False also for a publisher that cannot look

    async def check(self) -> list[DestinationCheck]:
        """Look at every destination now, and log what changed: one line per destination
        that is not there (or comes back)."""
        try:
            found = await check_destinations(self.publisher)
        except Exception as exc:  # the contract says it never raises: an adapter bug, not a reason to stop
            log.warning("checking the destinations failed: %s", first_line(exc), exc_info=True)
            return []
        if self.claim_check is not None:
            found = [*(found or ()), *await self.claim_check.check_destinations()]
        if found is None:
            return []
        first = not self.checked
        self.checked = True
        for check in found:
            self._note(self.checks.get(check.destination), check)
            self.checks[check.destination] = check
        if first and not self.absent():
            log.info("destinations checked: %s", "; ".join(c.describe() for c in found))
        return found

    def _note(self, before: DestinationCheck | None, now: DestinationCheck) -> None:
        if now.known_absent:
            if before is None or before.state is not now.state:
                log.error(
                    "destination %s; its messages wait (no attempt spent) and /readyz answers 503 until it is there",
                    now.describe(),
                )
        elif before is not None and before.known_absent:
            log.info("destination %s is there now", now.destination)
        elif now.state is DestinationState.DENIED and before is None:
            log.warning("cannot look at destination %s: the first publish tells whether it is there", now.describe())

    def absent(self) -> list[DestinationCheck]:
        """The destinations last found missing or unreachable."""
        return [c for c in self.checks.values() if c.known_absent]

    def destination_changed(self, name: str, is_open: bool) -> None:
        """:class:`relay.routing.DestinationHealth`'s callback: a route's destination paused or resumed."""
        if is_open:
            self.paused.add(name)
        else:
            self.paused.discard(name)

    async def watch(self, stop: asyncio.Event) -> None:
        """Check again, on :data:`RECHECK`'s schedule, while a destination is absent."""
        failures = 0
        while self.absent() and not stop.is_set():
            failures += 1
            await sleep_unless_stopped(stop, RECHECK.ceiling(failures))
            if not stop.is_set():
                await self.check()


def not_ready(breaker: CircuitBreaker, destinations: Destinations) -> str | None:
    """Why the broker side of the relay is not ready (points 2 to 4 above), or None."""
    if breaker.is_open:
        return f"broker: {breaker.reason or 'unavailable'}"
    absent = destinations.absent()
    if absent:
        return f"destination {absent[0].describe()}" + _more(len(absent))
    if destinations.paused:
        paused = sorted(destinations.paused)
        return f"destination {', '.join(paused[:SHOWN_NAMES])} paused: it refused every message" + _more(
            len(paused), SHOWN_NAMES
        )
    publisher = destinations.publisher
    held: Sequence[str] = publisher.unroutable() if isinstance(publisher, ReportsUnroutable) else ()
    if held:
        return f"unroutable: {', '.join(held[:SHOWN_NAMES])} reach no queue; their messages wait" + _more(
            len(held), SHOWN_NAMES
        )
    return None


def _more(count: int, shown: int = 1) -> str:
    return f" (and {count - shown} more)" if count > shown else ""
