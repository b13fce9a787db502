"""One outbox's place in a relay process that serves several (:mod:`relay.fleet`): what
its run borrows from the process instead of making its own, and where it reports how it
is doing.

A run given a :class:`Member` (relay.runner.run_relay) uses the process's pool for its
database, the database's wake-up listener, the process's metrics (labelled with the
outbox's name) and a publisher the process starts and closes; it neither serves the
metrics endpoint nor closes what it borrowed. It tells the member when it is delivering
and how to check it then, so that ``/readyz`` can answer for every outbox.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psycopg_pool import AsyncConnectionPool

from relay.arrivals import Arrivals
from relay.wakeup import Channels

if TYPE_CHECKING:  # prometheus-client is imported only when metrics are asked for
    from relay.httpd import ReadyCheck
    from relay.metrics import RelayMetrics


@dataclass
class Member:
    """What the process lends one outbox's run, and what the run reports back."""

    name: str
    pool: AsyncConnectionPool[Any]
    channels: Channels | None = None  # None: this outbox's relays are not woken (notify off)
    arrivals: Arrivals | None = None  # the process's, shared by every outbox
    metrics: RelayMetrics | None = None
    # Set by the run while it delivers: database and broker checks of this outbox.
    check: ReadyCheck | None = None
    # Why the outbox does not deliver now (its last start failed, or it is starting).
    held: str | None = "starting"
    # The publisher's destination changes, fanned out to each outbox that shares it.
    on_destination: list[Callable[[str, bool], None]] = field(default_factory=list)

    def delivering(self, check: ReadyCheck) -> None:
        """The run's workers start; ``check`` tells whether its database and broker answer."""
        self.check, self.held = check, None
        if self.metrics is not None:
            self.metrics.set_held(False)

    def hold(self, reason: str) -> None:
        """The outbox does not deliver now, for ``reason`` (one line, masked)."""
        self.check, self.held = None, reason
        if self.metrics is not None:
            self.metrics.set_held(True)
