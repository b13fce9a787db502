"""Turns a publish outcome into the decision finalize writes: the failure-class policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from relay.backoff import Backoff
from relay.contract import TIMEOUT_PREFIX
from relay.dsn import mask
from relay.errors import (
    BrokerUnavailable,
    Defer,
    DestinationUnavailable,
    NotSent,
    PermanentError,
    RetryableError,
)
from relay.message import Decision, OutboxMessage

# last_error is for people reading `relay dead list`; a stack of nested SDK reprs can be
# kilobytes, and a row should not grow with every retry.
MAX_ERROR_CHARS = 1000


@dataclass(frozen=True)
class Policy:
    """How failures are retried. Every number is a setting of `relay start`."""

    max_attempts: int = 12
    backoff: Backoff = field(default_factory=Backoff)
    # A message deferred for longer than this since it was written goes to 'dead'.
    defer_max_age: timedelta = timedelta(days=1)
    # While the broker refuses everything (down, or a missing queue or exchange), workers
    # probe at most this far apart, so delivery resumes within seconds of the fix.
    outage_backoff: Backoff = field(
        default_factory=lambda: Backoff(base=timedelta(milliseconds=500), cap=timedelta(seconds=5))
    )

    def decide(self, message: OutboxMessage, outcome: BaseException | None, *, broker_failures: int = 1) -> Decision:
        if outcome is None:
            return Decision.published(message)
        if isinstance(outcome, DestinationUnavailable):
            # Its destination's own probe schedule, not the process's outage count.
            return Decision.broker_unavailable(message, outcome.retry_after.total_seconds(), describe(outcome))
        if isinstance(outcome, BrokerUnavailable):
            return Decision.broker_unavailable(
                message, self.outage_backoff.delay(broker_failures).total_seconds(), describe(outcome)
            )
        if isinstance(outcome, NotSent):  # held back by the adapter's own limit: never dead for it
            return Decision.defer(message, max(outcome.delay.total_seconds(), 0.0), describe_text(outcome.reason))
        if isinstance(outcome, Defer):
            # The wait a destination asks for, but at least the backoff base: an answer of
            # "now" (HTTP's Retry-After: 0, or a date already past) must not become a loop
            # of claims, requests and finalizes as fast as the relay can go.
            delay = max(outcome.delay.total_seconds(), self.backoff.base.total_seconds())
            if message.age_s + delay > self.defer_max_age.total_seconds():
                return Decision.dead(
                    message,
                    describe_text(f"deferred past defer_max_age ({self.defer_max_age}): {outcome.reason}"),
                )
            return Decision.defer(message, delay, describe_text(outcome.reason))
        if isinstance(outcome, RetryableError):
            if message.attempt >= self.max_attempts:
                return Decision.dead(
                    message, f"retries exhausted after {message.attempt} attempts: {describe(outcome)}"
                )
            return Decision.retry(message, self.backoff.delay(message.attempt).total_seconds(), describe(outcome))
        if isinstance(outcome, PermanentError):
            return Decision.dead(message, describe(outcome))
        # Nobody classified this: it is a bug in an adapter, not a transient fault, so it is
        # not retried as one. Dead at once (the worker logs the traceback), for a human to
        # re-drive once the adapter is fixed.
        return Decision.dead(message, f"unclassified publisher error (adapter bug?): {describe(outcome)}")


def failure_class(exc: BaseException) -> str:
    """The failure class of an outcome, as the metrics label it."""
    if isinstance(exc, BrokerUnavailable):
        return "broker_unavailable"
    if isinstance(exc, Defer):
        return "defer"
    if isinstance(exc, PermanentError):
        return "permanent"
    if isinstance(exc, RetryableError):
        return "timeout" if str(exc).startswith(TIMEOUT_PREFIX) else "retryable"
    return "unclassified"


def describe(exc: BaseException) -> str:
    text = str(exc)
    return describe_text(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def describe_text(text: str) -> str:
    """``text`` as last_error holds it: passwords masked, then cut (in that order: a cut
    through a password would leave a piece the mask no longer recognises)."""
    text = mask(text)
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"
