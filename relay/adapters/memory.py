"""An in-memory publisher for tests and dry runs, scriptable per message."""

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
    pass


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
            outcomes.append(result)
        return outcomes

    def delivered_ids(self) -> list[int]:
        return [m.id for m in self.delivered]
