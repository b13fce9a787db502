"""Fairness between the outboxes of one process (relay.fleet): an outbox that wakes with
work goes before the outboxes that are draining a backlog.

Every outbox's workers share one event loop, one or two cores and often one database. A
worker draining a backlog claims batch after batch, each step of it (decoding a claim,
publishing, writing outcomes) holding the loop for a few milliseconds, and its statements
keep PostgreSQL busy; an outbox with one new event would take its turns between them, and
its event wait behind several of their steps. So a worker that wakes from idle *arrives*
until its first batch is written, and while any worker of the process arrives, the workers
whose last claim came back full (draining) give way before their next claim: the arriving
batch gets the loop and the database to itself, for a few milliseconds.

Giving way is bounded (:data:`GIVE_WAY_S`): an arriving outbox whose database hangs (a lock,
a failover) must not hold the others back for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib

# The longest a draining worker waits for arrivals before it claims anyway: an arriving
# batch of one takes a few milliseconds alone (claim, publish, finalize).
GIVE_WAY_S = 0.05


class Arrivals:
    """The workers of a process that woke from idle and have not written their first
    batch yet."""

    def __init__(self) -> None:
        self._arriving: set[str] = set()
        self._clear = asyncio.Event()
        self._clear.set()

    def arrive(self, worker: str) -> None:
        """``worker`` woke from idle and is about to claim."""
        self._arriving.add(worker)
        self._clear.clear()

    def leave(self, worker: str) -> None:
        """``worker`` wrote its first batch (or found nothing): draining workers go on."""
        self._arriving.discard(worker)
        if not self._arriving:
            self._clear.set()

    async def give_way(self) -> None:
        """For a draining worker, before it claims: wait while another worker arrives, at
        most :data:`GIVE_WAY_S`."""
        if self._clear.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._clear.wait(), GIVE_WAY_S)
