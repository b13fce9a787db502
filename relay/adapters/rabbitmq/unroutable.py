"""Routing keys an exchange routes to no queue, each held on its own.

A mandatory publish that no queue is bound for comes back (``basic.return``, 312
NO_ROUTE) and then confirmed. Under ``--unroutable wait`` (the default) that is a
configuration fault, like a missing exchange, not the message's: the message waits,
attempt refunded, never 'dead'. Its routing key is held alone, so one key without a queue
(``{aggregate_type}.{event_type}`` gives one key per event family) never pauses the others
on the same exchange: while a key is held its messages are answered at once, unsent, and
one of them goes as a probe every 0.5 s to 5 s (the routes' own schedule,
:mod:`relay.routing`) until a queue is bound and the probe is routed. Sending a probe is
harmless: an unroutable message reaches no queue.

One ERROR line when a key starts being held, one INFO line when it flows again; the keys
held now are what :meth:`RabbitPublisher.unroutable` lists (for /readyz and the
``outbox_relay_unroutable_routing_keys`` gauge).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from relay.errors import DestinationUnavailable, shown

# A held key is probed this long after its first return, doubling up to the cap: quick to
# notice a queue bound right after the relay started, one publish every 5 s in a long fault.
PROBE_FIRST_S = 0.5
PROBE_CAP_S = 5.0
# Keys held at once, per exchange. A template over {aggregate_id} can make a key per
# aggregate: past this many, further keys are held without being remembered (each of their
# messages is sent again when claimed again, which is harmless) and without a line each.
MAX_KEYS = 1000


@dataclass
class _Held:
    since: float
    failures: int = 0
    next_probe: float = 0.0
    probing: bool = False


class UnroutableKeys:
    """The routing keys of one exchange that came back unroutable, and their probes.

    :param log: the adapter's logger.
    :param exchange: how lines name the exchange ("exchange 'orders' at amqp://...").
    """

    def __init__(self, log: logging.Logger, exchange: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self.exchange = exchange
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._overflow_said = False

    def name(self, key: str) -> str:
        """How lines, outcomes and /readyz name a held key."""
        return f"{self.exchange} routing key {shown(key)}"

    def held(self) -> tuple[str, ...]:
        """The keys held now, named (at most :data:`MAX_KEYS`)."""
        return tuple(self.name(key) for key in self._held)

    def is_held(self, key: str) -> bool:
        return key in self._held

    def take_probe(self, key: str) -> bool:
        """For a held key: True for the one message that may go now as its probe."""
        held = self._held[key]
        if held.probing or self._clock() < held.next_probe:
            return False
        held.probing = True
        return True

    def waiting(self, key: str) -> DestinationUnavailable:
        """The outcome of a message not sent because its key is held."""
        held = self._held[key]
        return self._outcome(
            key,
            f"{self.name(key)} reaches no queue (312 NO_ROUTE on an earlier message): held unsent,"
            " no attempt spent, until a queue is bound for it",
            _ceiling(held.failures),
        )

    def returned(self, key: str, reason: str) -> DestinationUnavailable:
        """A message of ``key`` came back unroutable: hold the key (or keep holding it)."""
        held = self._held.get(key)
        if held is None:
            if len(self._held) >= MAX_KEYS:
                if not self._overflow_said:
                    self._overflow_said = True
                    self._log.error(
                        "more than %d routing keys of %s reach no queue: further ones are held too,"
                        " without a line each",
                        MAX_KEYS,
                        self.exchange,
                    )
                return self._outcome(key, reason, PROBE_CAP_S)  # not remembered, so not probed: the longest wait
            held = self._held[key] = _Held(since=self._clock())
            self._log.error(
                "%s reaches no queue (312 NO_ROUTE): its messages wait, no attempt spent, and go as soon as"
                " a queue is bound for it",
                self.name(key),
            )
        held.failures += 1
        held.probing = False
        held.next_probe = self._clock() + _ceiling(held.failures)
        return self._outcome(
            key, f"{reason}; held, no attempt spent, until a queue is bound for it", _ceiling(held.failures)
        )

    def delivered(self, key: str) -> None:
        """A message of ``key`` was routed: a held key flows again."""
        held = self._held.pop(key, None)
        if held is not None:
            self._log.info(
                "%s reaches a queue again after %.1fs; its messages go", self.name(key), self._clock() - held.since
            )
            if not self._held:
                self._overflow_said = False

    def no_verdict(self, key: str) -> None:
        """A held key's probe ended neither routed nor returned (a timeout, a lost channel)."""
        held = self._held.get(key)
        if held is not None:
            held.probing = False

    def _outcome(self, key: str, text: str, retry_after_s: float) -> DestinationUnavailable:
        return DestinationUnavailable(text, destination=self.name(key), retry_after=timedelta(seconds=retry_after_s))


def _ceiling(failures: int) -> float:
    """Seconds to the next probe after ``failures`` returns: 0.5, 1, 2, 4, then 5."""
    return min(PROBE_CAP_S, PROBE_FIRST_S * 2.0 ** min(max(failures, 1) - 1, 16))
