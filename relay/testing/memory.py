"""An in-memory publisher for tests, scriptable per message: the relay delivers into a
list, and a test decides each message's outcome (delivered, a failure class, a broker
that never answers)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from relay.contract import Outcome
from relay.message import OutboxMessage

# Given a message, return None to deliver it, return an exception to fail it with that
# outcome, or return the STALL sentinel to hang until cancelled (a stuck broker).
Script = Callable[[OutboxMessage], "BaseException | _Stall | None"]


class _Stall:
    def __repr__(self) -> str:
        return "STALL"


STALL = _Stall()


@dataclass
class InMemoryPublisher:
    """Records every delivered message; ``script`` decides each message's outcome.

    ``delivered`` holds messages in delivery order; ``attempts`` every message it was
    asked to publish, delivered or not. ``delay`` simulates broker latency per batch.
    """

    script: Script | None = None
    delay: float = 0.0
    name: str = "memory"
    delivered: list[OutboxMessage] = field(default_factory=list)
    attempts: list[OutboxMessage] = field(default_factory=list)
    started: bool = False
    closed: bool = False
    # Set at each delivery, for wait_delivered.
    _arrived: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False, compare=False)

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        if self.delay:
            await asyncio.sleep(self.delay)
        outcomes: list[Outcome] = []
        for message in batch:
            self.attempts.append(message)
            result = self.script(message) if self.script else None
            if isinstance(result, _Stall):
                await asyncio.Event().wait()  # until the relay's publish deadline cancels us
                raise AssertionError("unreachable")
            if result is None:
                self.delivered.append(message)
                self._arrived.set()
            outcomes.append(result)
        return outcomes

    def delivered_ids(self) -> list[int]:
        """The outbox ids of the delivered messages, in delivery order."""
        return [m.id for m in self.delivered]

    async def wait_delivered(self, count: int) -> list[OutboxMessage]:
        """The delivered messages once there are at least ``count`` (bound the wait with
        ``asyncio.timeout``)."""
        while len(self.delivered) < count:
            self._arrived.clear()
            await self._arrived.wait()
        return list(self.delivered)
