"""What every adapter says when its destination refuses every message, and when it takes
messages again: one ERROR line when an outage starts (or its cause changes), one INFO line
when delivery resumes, nothing per batch in between. An outage spends no attempts (the
messages come back as ``relay.BrokerUnavailable``), so these two lines are how an operator
learns of it from the log; the breaker's state is in the metrics and ``/readyz``."""

from __future__ import annotations

import logging
import time


class OutageLog:
    """The outage state of one destination, for its adapter's logger.

    :param log: the adapter's logger (``adapters.sqs``, ``adapters.rabbitmq``), so that the
        lines are filtered and routed with the adapter's others.
    :param destination: how the lines name the destination ("SQS queue https://...").
    """

    def __init__(self, log: logging.Logger, destination: str) -> None:
        self._log = log
        self.destination = destination
        self.reason: str | None = None
        self._key: str | None = None
        self._since = 0.0

    def refused(self, reason: str, *, key: str | None = None) -> None:
        """The destination refused a whole batch for ``reason``. ``key`` says which
        refusals are the same outage (an error code, where the text varies per request);
        by default the reason itself."""
        key = reason if key is None else key
        if key == self._key:
            return
        if self._key is None:
            self._since = time.monotonic()
        self._key, self.reason = key, reason
        self._log.error(
            "%s is unavailable (%s); its messages wait without spending attempts"
            " and are tried again every few seconds until it is fixed",
            self.destination,
            reason,
        )

    def delivered(self) -> None:
        """The destination confirmed a message: the outage, if there was one, is over."""
        if self._key is None:
            return
        self._log.info(
            "%s is available again after %.1fs; delivery resumed (was: %s)",
            self.destination,
            time.monotonic() - self._since,
            self.reason,
        )
        self._key = self.reason = None
