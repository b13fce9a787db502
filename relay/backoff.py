"""Full-jitter exponential backoff ("Exponential Backoff And Jitter", AWS Architecture Blog).

When an outage ends, messages that all retry on the same schedule hit the recovered
broker at once; a uniform draw between zero and the exponential cap spreads them out.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True)
class Backoff:
    """``delay(n)`` is uniform in ``[0, min(cap, base * 2**(n-1))]`` for the n-th failure.

    With the defaults (1 s base, 5 min cap) the ceiling doubles from 1 s to 256 s over
    nine failures and then stays at 5 minutes.
    """

    base: timedelta = timedelta(seconds=1)
    cap: timedelta = timedelta(minutes=5)
    rand: Callable[[float, float], float] = random.uniform

    def ceiling(self, failures: int) -> float:
        """The upper bound, in seconds, of the delay after ``failures`` failures."""
        exponent = min(max(failures, 1) - 1, 62)  # beyond 2**62 the cap has long won
        return min(self.cap.total_seconds(), self.base.total_seconds() * float(2**exponent))

    def delay(self, failures: int) -> timedelta:
        return timedelta(seconds=self.rand(0.0, self.ceiling(failures)))
