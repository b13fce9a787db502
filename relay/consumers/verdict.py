"""What the runners need of :class:`relay.Consumer`: an event's verdict, and how long to
hold back what may not be acknowledged yet."""

from __future__ import annotations

import enum
import logging
from datetime import timedelta
from typing import Protocol

from relay.inbox import Received

# How long a runner waits after its broker call failed (the service unreachable, a
# connection being re-established) before it asks again: once a second keeps the log to a
# line a second while an outage lasts, and costs nothing once the broker is back.
BROKER_PAUSE_S = 1.0


class Verdict(enum.Enum):
    """What became of one event."""

    APPLIED = "applied"
    """New: the handler ran and its transaction committed. Acknowledge the message."""
    DUPLICATE = "duplicate"
    """Applied before (by event id, or by number in its epoch): nothing ran. Acknowledge."""
    OUT_OF_ORDER = "out_of_order"
    """An earlier event of its aggregate has not been applied: nothing was recorded. Do not
    acknowledge; let it come again after a delay."""

    @property
    def settled(self) -> bool:
        """Whether the message may be acknowledged (deleted, committed past)."""
        return self is not Verdict.OUT_OF_ORDER


class Applier(Protocol):
    """:class:`relay.Consumer` as the runners see it."""

    retry_delay: timedelta

    async def apply(self, event: Received) -> Verdict: ...


async def settles(applier: Applier, event: Received, log: logging.Logger, retried: str) -> bool:
    """Whether the message carrying ``event`` may be acknowledged now: its event applied
    (committed) or a duplicate. False when it came before an earlier event of its
    aggregate, or the handler or the database failed (logged, with how it is ``retried``)."""
    try:
        return (await applier.apply(event)).settled
    except Exception:
        log.exception("event %s: not applied, %s in %s", event.event_id, retried, applier.retry_delay)
        return False
