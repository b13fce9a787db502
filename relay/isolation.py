"""Finding the one message that broke a batch: its rows published apart, one at a time,
while nothing else of the process publishes.

A failure of what a batch shares (the broker closed the connection or channel mid-batch)
says nothing about which message caused it, if any did: an oversized or malformed message
the relay's own checks did not foresee takes every message of the batch down with it, and
retried together, the batch would fail together until its innocent rows ran out of
attempts. So a worker whose batch comes back with :class:`relay.errors.SharedFailure`
publishes those rows again, each alone, in an exclusive turn: the innocent go through, and
the culprit fails alone and spends its own attempt. The turn is exclusive because the
process's workers share the broker connection: a culprit published alone would otherwise
fail the other workers' batches again.

What it costs when nothing fails: one shared turn taken and given back per batch (an
asyncio condition, no I/O).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class PublishTurns:
    """A process's publishes: any number at once (shared), or one worker's alone
    (exclusive), which waits for the shared ones in flight and holds new ones back."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0  # exclusive turns asked for: new shared ones wait behind them

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            async with self._changed:
                self._shared -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._changed:
            self._waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._exclusive and self._shared == 0)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            async with self._changed:
                self._exclusive = False
                self._changed.notify_all()
