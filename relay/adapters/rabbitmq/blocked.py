"""RabbitMQ's blocked connections: a resource alarm (memory or disk over its watermark)
makes the broker stop reading from every publishing connection, after telling the client
so with ``connection.blocked`` ("low on memory", "low on disk") and later
``connection.unblocked``.

Nothing is wrong with the messages then, so they must not spend attempts: while blocked,
the adapter sends nothing and answers every batch with ``BrokerUnavailable`` at once (the
breaker pauses claims and probes), and a batch already waiting for its confirms when the
block arrives stops waiting and gets the same answer for what was not confirmed (the
broker may still have some of it; consumers de-duplicate by message_id).

aiormq 7 advertises the ``connection.blocked`` capability and handles both frames, but
tells nobody: it only logs them and flips a private event that its writer consults once,
at connect (aio-pika issue #506). So :meth:`Blocking.watch` wraps aiormq's two frame
handlers on each new connection, keeping what they do and adding ours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from relay.errors import BrokerUnavailable
from relay.textsafe import clip, escape

# The frame handlers aiormq's reader calls for Connection.Blocked and .Unblocked (its
# private methods, name-mangled); checked for, so another aiormq only loses the fast path.
_ON_BLOCKED = "_Connection__handle_connection_blocked"
_ON_UNBLOCKED = "_Connection__handle_connection_unblocked"

Handler = Callable[[Any], Awaitable[None]]


def alarm_kind(reason: str) -> str:
    """``memory``, ``disk`` or ``memory & disk`` from the broker's text ("low on memory",
    "low on disk", both joined by " & "); another text as it came, made safe to log."""
    text = reason.lower()
    kinds = [kind for kind in ("memory", "disk") if f"low on {kind}" in text]
    return " & ".join(kinds) if kinds else escape(clip(reason, 100)) or "no reason given"


class Blocking:
    """Whether RabbitMQ has blocked the publisher's connection, and the confirm waits a
    block cuts short.

    :param log: the adapter's logger.
    :param where: the broker, as log lines name it (no password).
    """

    def __init__(self, log: logging.Logger, where: str) -> None:
        self._log = log
        self._where = where
        self.reason: str | None = None  # the broker's text while blocked
        self._since = 0.0
        self._watched: object | None = None
        self._waits: set[asyncio.Timeout] = set()

    def watch(self, connection: object) -> None:
        """Hear the blocks of ``connection`` (an ``aiormq.Connection``). Called before each
        publish; a connection that is not the one watched (a reconnect) starts unblocked,
        as the broker only blocks a connection once it publishes on it."""
        if connection is self._watched:
            return
        self._watched = connection
        self.reason = None
        on_blocked = getattr(connection, _ON_BLOCKED, None)
        on_unblocked = getattr(connection, _ON_UNBLOCKED, None)
        if not (callable(on_blocked) and callable(on_unblocked)):
            self._log.warning(
                "this aiormq does not let the relay hear RabbitMQ's connection.blocked: during a"
                " resource alarm batches wait out their confirm timeout and are retried"
            )
            return

        async def blocked(frame: Any) -> None:
            await on_blocked(frame)
            if self._watched is connection:
                self.block(str(getattr(frame, "reason", "") or ""))

        async def unblocked(frame: Any) -> None:
            await on_unblocked(frame)
            if self._watched is connection:
                self.unblock()

        setattr(connection, _ON_BLOCKED, blocked)
        setattr(connection, _ON_UNBLOCKED, unblocked)

    def block(self, reason: str) -> None:
        if self.reason is None:
            self._since = time.monotonic()
            # INFO: the outage itself is the adapter's one ERROR line (adapters.outage).
            self._log.info(
                "RabbitMQ at %s blocked the connection (%r: its %s alarm is on); publishing paused,"
                " messages wait without spending attempts until it unblocks",
                self._where,
                escape(clip(reason, 200)),
                alarm_kind(reason),
            )
        self.reason = reason
        now = asyncio.get_running_loop().time()
        for wait in self._waits:
            wait.reschedule(now)  # the confirms would not come before the unblock

    def unblock(self) -> None:
        if self.reason is not None:
            self._log.info(
                "RabbitMQ at %s unblocked the connection after %.1fs; publishing resumes",
                self._where,
                time.monotonic() - self._since,
            )
        self.reason = None

    def refusal(self) -> BrokerUnavailable | None:
        """What a batch gets while blocked (None: not blocked)."""
        if self.reason is None:
            return None
        return BrokerUnavailable(
            f"blocked: {alarm_kind(self.reason)} (RabbitMQ at {self._where} says"
            f" {escape(clip(self.reason, 200))!r}: a resource alarm); messages wait, no attempt"
            " spent, until it unblocks"
        )

    @contextlib.contextmanager
    def cut_short(self, wait: asyncio.Timeout) -> Iterator[None]:
        """While inside, a block makes ``wait`` expire at once."""
        self._waits.add(wait)
        if self.reason is not None:  # blocked while the batch was getting its channel
            wait.reschedule(asyncio.get_running_loop().time())
        try:
            yield
        finally:
            self._waits.discard(wait)
