"""The overview chart's data: depth and oldest-waiting age, sampled by the console itself
and kept in memory for a window (an hour by default), oldest sample dropped first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from relay.dsn import mask
from relay.errors import first_line
from relay.summary import StatusSummary

log = logging.getLogger("relay.console")


@dataclass(frozen=True)
class Sample:
    at: datetime  # the database clock when it was read
    awaiting: int  # pending + processing
    dead: int
    oldest_waiting_age_s: float  # 0 when nothing waits


class History:
    """Samples at most ``window`` old, in the order taken."""

    def __init__(self, window: timedelta = timedelta(hours=1)) -> None:
        self.window = window
        self._samples: deque[Sample] = deque()

    def add(self, s: StatusSummary) -> Sample:
        sample = Sample(s.at, s.awaiting, s.dead, s.oldest_waiting_age_s or 0.0)
        self._samples.append(sample)
        while self._samples and sample.at - self._samples[0].at > self.window:
            self._samples.popleft()
        return sample

    def samples(self) -> list[Sample]:
        return list(self._samples)


async def sample_forever(
    history: History, read: Callable[[], Awaitable[StatusSummary]], every: timedelta, stop: asyncio.Event
) -> None:
    """Add a sample every ``every`` until ``stop``; a failed read is logged once per outage
    and leaves a gap in the chart, never stops the sampling."""
    failing = False
    while not stop.is_set():
        try:
            history.add(await read())
            if failing:
                log.info("console: status readable again")
            failing = False
        except Exception as exc:  # the database away: the pages say so themselves
            if not failing:
                log.warning("console: could not sample the status: %s", mask(first_line(exc)))
            failing = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every.total_seconds())
