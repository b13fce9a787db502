"""The circuit breaker that stops claiming while the broker refuses everything.

When a whole batch comes back ``BrokerUnavailable`` (broker down, or a configuration
fault such as a missing queue or exchange), every worker of the process stops claiming:
claiming more would only move rows to 'processing' and back. One worker at a time then
probes with a single-message claim after a backoff; the probe's row is handed back with
its attempt refunded, so an outage of any length spends no attempt and sends nothing to
'dead'. The first probe that gets any other outcome closes the breaker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta

from relay.backoff import Backoff

log = logging.getLogger("relay.breaker")


class CircuitBreaker:
    """Shared by the workers of one process. States: closed (claim freely), open (wait),
    and probing (one worker claims one message to test the broker)."""

    def __init__(
        self,
        backoff: Backoff | None = None,
        *,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Probes start 0.5 s apart and back off to one every 5 s: quick to notice a broker
        # that comes back (or a queue that gets created), cheap during a long outage.
        self.backoff = backoff or Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=5))
        self._on_change = on_change
        self._clock = clock
        self._failures = 0
        self._next_probe = 0.0
        self._probing = False
        self._opened_at = 0.0
        self._changed = asyncio.Event()
        self.reason = ""

    @property
    def is_open(self) -> bool:
        return self._failures > 0

    @property
    def failures(self) -> int:
        """Consecutive refused batches: 0 while closed."""
        return self._failures

    async def permit(self, stop: asyncio.Event) -> int | None:
        """Wait until this worker may claim. Returns the batch-size limit (None: no limit,
        1: this worker is the probe), or None after ``stop`` without a permit."""
        while not stop.is_set():
            if not self.is_open:
                return None
            now = self._clock()
            if not self._probing and now >= self._next_probe:
                self._probing = True
                return 1
            wait = max(0.05, self._next_probe - now) if not self._probing else 1.0
            self._changed.clear()
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._changed.wait())]
            try:
                await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        return None

    def record(self, *, unavailable: bool, reason: str = "", probe: bool = False) -> None:
        """Report a batch's verdict: ``unavailable`` when the broker refused all of it."""
        if probe:
            self._probing = False
        if unavailable:
            self._failures += 1
            self._next_probe = self._clock() + self.backoff.ceiling(self._failures)
            if self._failures == 1:
                self._opened_at = self._clock()
                self.reason = reason
                log.warning("broker unavailable, pausing claims and probing: %s", reason)
                if self._on_change:
                    self._on_change(True)
            elif reason != self.reason:
                self.reason = reason
                log.warning("broker still unavailable: %s", reason)
        elif self._failures:
            outage = self._clock() - self._opened_at
            log.info("broker is back after %.1fs; resuming claims", outage)
            self._failures = 0
            self.reason = ""
            if self._on_change:
                self._on_change(False)
        self._changed.set()
