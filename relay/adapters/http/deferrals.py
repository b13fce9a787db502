"""Repeated ``Retry-After`` answers to one message back off.

A receiver may answer ``Retry-After: 0`` (or a date already past) to every request: taken
at its word, one message would be claimed, sent, deferred and finalized as fast as the
relay can loop (541 requests in 8 s for one message), its attempt refunded every time,
until ``--defer-max-age``. Two floors stop that:

- every Defer waits at least ``--backoff-base`` (the relay's policy, for every adapter);
- the n-th Retry-After in a row for the same message waits at least
  ``REPEAT_FLOOR_BASE * 2**(n-1)``: 1 s, 2 s, 4 s, ... up to ``--http-retry-after-max``.
  A receiver asking for longer is obeyed as it asks (within the cap). Any other answer to
  the message ends its run; a request the relay held back itself (NotSent) is no answer
  and leaves the run as it was.

The runs are this process's memory: a message claimed by another relay starts its run
there again, which costs that relay a few quick retries, not a loop.
"""

from __future__ import annotations

from datetime import timedelta

from relay.contract import Outcome
from relay.errors import Defer, NotSent
from relay.message import OutboxMessage

# The floor of the first Retry-After of a run; it doubles with each one after it.
REPEAT_FLOOR_BASE = timedelta(seconds=1)
# Messages whose run is remembered at once: the least recently deferred is forgotten past
# it (it then starts again at REPEAT_FLOOR_BASE), so a backlog of millions deferred by a
# throttling API holds at most this many small entries.
TRACKED_MAX = 10_000
# Beyond 2**40 s every cap has long won; keeps the arithmetic small for any run length.
_MAX_EXPONENT = 40


class Deferrals:
    """The current run of Retry-After answers of each message, and its floor.

    :param cap: the longest floor (``--http-retry-after-max``).
    """

    def __init__(self, cap: timedelta) -> None:
        self.cap = cap
        self._runs: dict[str, int] = {}  # insertion order: least recently deferred first

    def floor(self, run: int) -> timedelta:
        """The least wait of the ``run``-th Retry-After in a row."""
        exponent = min(max(run, 1) - 1, _MAX_EXPONENT)
        return min(REPEAT_FLOOR_BASE * float(2**exponent), self.cap)

    def paced(self, message: OutboxMessage, outcome: Outcome) -> Outcome:
        """``outcome`` of ``message``, a Defer lengthened to its run's floor."""
        if isinstance(outcome, NotSent):
            return outcome
        key = message.event_id or str(message.id)
        run = self._runs.pop(key, 0) + 1
        if not isinstance(outcome, Defer):
            return outcome
        self._runs[key] = run
        if len(self._runs) > TRACKED_MAX:
            del self._runs[next(iter(self._runs))]
        floor = self.floor(run)
        if outcome.delay >= floor:
            return outcome
        return Defer(floor, f"{outcome.reason} (deferral {run} in a row: waiting {floor.total_seconds():g}s)")
