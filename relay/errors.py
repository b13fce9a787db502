"""The failure classes a publisher sorts every outcome into, and the relay's own errors.

Broker adapters translate SDK exceptions into these classes at their boundary; the
dispatch loop only ever sees these, never an SDK type. An exception that is none of
them is treated as a bug (see ``relay.decide``): it is not retried as if transient.
"""

from __future__ import annotations

from datetime import timedelta


class RetryableError(Exception):
    """A transient failure (timeout, lost connection, throttling, 5xx).

    The message is rescheduled with full-jitter backoff and its attempt counts; once
    ``max_attempts`` is reached it goes to 'dead'.
    """


class SharedFailure(RetryableError):
    """A failure of what the whole batch shared (the broker closed the connection or the
    channel mid-batch), which says nothing about which message caused it, if any did. The
    worker publishes those messages again apart (relay.isolation) before it spends an
    attempt of each: only the one that fails alone pays."""


class BatchRaised(SharedFailure):
    """The publisher raised for a whole batch instead of returning one outcome per message
    (an adapter bug, or a library error its adapter did not expect). Which message caused
    it, if any did, is unknown: the worker publishes the batch's messages again apart, and
    only the one that raises alone is charged (as unclassified: dead, for a human). The
    original exception is the ``__cause__``."""


class PermanentError(Exception):
    """A failure no retry can fix (the message is too large, its content is refused).

    The message goes to 'dead' at once, for a human to look at.
    """


class NoRoomForReplayMarker(PermanentError):
    """The message fits its broker as it went out live, but not with the ``replay`` marker
    a replay adds (SQS and SNS: an 11th message attribute, or the size with it). A replay
    cannot send it: without the marker consumers and FIFO de-duplication would take it
    for the live delivery. ``relay replay`` names it and prints the command that leaves it
    out (``--exclude``), so its aggregate's other messages can still be replayed."""


class Defer(Exception):
    """The message cannot go yet for a reason that is not a failure.

    It is rescheduled after ``delay`` and the attempt the claim took is refunded, so
    deferring never exhausts ``max_attempts``. A ceiling on the age of the message
    (``defer_max_age``) stops a message from being deferred forever.
    """

    def __init__(self, delay: timedelta, reason: str) -> None:
        super().__init__(reason)
        self.delay = delay
        self.reason = reason


class NotSent(Defer):
    """The adapter held the message back for a limit of its own (a connection slot, a
    rate) and sent nothing: its request could no longer finish inside the publish
    deadline (:func:`relay.contract.publish_deadline`). Rescheduled after ``delay`` with
    the attempt refunded, like a :class:`Defer`; unlike one, its age is not held against
    ``defer_max_age``: the relay's own pacing is not the destination's verdict, and a
    backlog behind a rate limit must not go to 'dead' unsent."""


class BrokerUnavailable(Exception):
    """The broker refuses every message, whatever the message: it is unreachable, or a
    configuration fault (missing exchange or queue, access denied) stops all delivery.

    Not the message's fault, so no attempt is spent and nothing goes to 'dead'; the
    message is rescheduled and the worker backs off before it claims again.
    """


class DestinationUnavailable(BrokerUnavailable):
    """One destination of several refuses its messages (or a message has no destination at
    all, or its routing key reaches no queue): those messages wait, attempt refunded, never
    'dead', while the process keeps claiming for the others. Raised by relay.routing, and by
    an adapter for a part of its destination only (adapters.rabbitmq.unroutable: one
    routing key), never for the whole of it (that is BrokerUnavailable).

    :param destination: which one, for people and the metrics.
    :param retry_after: when its messages are worth claiming again (its next probe).
    """

    def __init__(self, message: str, *, destination: str, retry_after: timedelta) -> None:
        super().__init__(message)
        self.destination = destination
        self.retry_after = retry_after


def is_classified(exc: BaseException) -> bool:
    """Whether ``exc`` is one of the failure classes (anything else is an adapter bug)."""
    return isinstance(exc, RetryableError | PermanentError | Defer | BrokerUnavailable)


class ConfigError(Exception):
    """Invalid configuration or input, reported as one line with exit code 2."""


class DatabaseUnavailable(Exception):
    """PostgreSQL cannot be reached; the message names host and database, never a password."""


# How much of a rejected value an error line repeats: enough to recognise it, short enough
# that a value of a million characters still makes one readable line.
SHOWN_MAX = 60


def shown(value: object, limit: int = SHOWN_MAX) -> str:
    """``value`` as an error line quotes it: its repr, cut to ``limit`` characters with
    its full length said, so the line stays short whatever the input was."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error's text, stripped: what one log or error line
    quotes of someone else's message. An exception with no message gives its type's name
    (a blank line would say nothing); a text with none gives ''."""
    text = str(error)
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if not line and isinstance(error, BaseException):
        return type(error).__name__
    return line
