"""A replay from Python: :class:`Replay` does what `relay replay` does, built by the same
composition root (:func:`relay.compose.compose_replay`).

::

    from relay import Replay, Selection

    async with Replay(Selection(aggregates=("order-42",)), dsn=DSN, broker="rabbitmq",
                      amqp_url=AMQP, exchange="orders", to="orders-rebuild") as replay:
        print(replay.summary.count, "to replay")
        report = await replay.run()

Entering it connects to PostgreSQL (a session of its own, with the relay's session limits),
checks the outbox's schema, takes the plan of what the selection holds (nothing is
changed in the outbox, now or later) and starts the publisher; it raises
:class:`relay.ConfigError` when the selection holds no finished message. Leaving it closes
the publisher and the session.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Unpack

import psycopg

from relay.compose import ReplayParts, checked_session, compose_replay
from relay.contract import DestinationCheck, check_destinations
from relay.db.replay import PlanSummary, ReplayPlan
from relay.errors import ConfigError
from relay.options_typed import ReplayOptions
from relay.replay import Replayer, ReplayReport, Selection, check_run_id, count_of, new_run_id

__all__ = ["Replay"]

log = logging.getLogger("relay.replay")


class Replay:
    """Publishes finished messages again, in order per aggregate, changing nothing in the
    outbox; live relays keep running meanwhile.

    :param selection: what to replay (:class:`relay.replay.Selection`; checked here).
    :param run_id: the ``replay`` header's value, which a resumed replay keeps; a new one
        (the start time and a random suffix) by default.
    :param to: send everything to this destination of the broker (a queue URL, topic ARN
        or exchange), ignoring routes.
    :param rate: messages per second at most; as fast as the broker confirms by default.
    :param skip_failed: leave out a message that cannot be replayed and go on with the rest
        of its aggregate (by default its aggregate stops there, as a dead head stops it live).
    :param environ: read RELAY_* variables from this mapping (``os.environ``); none by default.
    :param config: a TOML config file, below both.
    :param settings: `relay replay`'s options by their flag's name (``dsn``, ``broker``,
        ``workers``, ...), typed by :class:`relay.options_typed.ReplayOptions`.
    """

    def __init__(
        self,
        selection: Selection,
        *,
        run_id: str | None = None,
        to: str | None = None,
        rate: float | None = None,
        skip_failed: bool = False,
        environ: Mapping[str, str] | None = None,
        config: str | None = None,
        **settings: Unpack[ReplayOptions],
    ) -> None:
        self.selection = selection.check()
        self.run_id = check_run_id(run_id.strip()) if run_id is not None else new_run_id()
        self.skip_failed = skip_failed
        self.parts: ReplayParts = compose_replay(settings, environ=environ, config=config, to=to, rate=rate)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._plan: ReplayPlan | None = None
        self._summary: PlanSummary | None = None
        self._started = False
        self._destinations_there = False

    @property
    def where(self) -> str:
        """Where the messages go, in words (the broker and its destinations or routes)."""
        return self.parts.where

    @property
    def summary(self) -> PlanSummary:
        """What the plan holds (inside ``async with``)."""
        if self._summary is None:
            raise RuntimeError("enter the Replay (async with) to take its plan first")
        return self._summary

    async def __aenter__(self) -> Replay:
        for line in self.parts.warnings:
            log.warning("%s", line)
        p = self.parts
        try:
            conn = await checked_session(p.dsn, p.names, p.session, application_name="outbox-relay replay")
        except BaseException:
            p.tracing.shutdown()
            raise
        try:
            checks = self.parts.limits.claim_check
            plan = ReplayPlan(
                conn,
                self.parts.names,
                spools=None if checks is None else checks.stores,
                spool_over=None if checks is None else checks.smallest_threshold,
            )
            summary = await plan.take(self.selection)
            if not summary.count:
                left_out = left_out_line(summary)
                raise ConfigError(
                    "no finished message matches the selection: nothing to replay"
                    + (f" ({left_out})" if left_out else "")
                )
            await self.parts.publisher.start()
        except BaseException:
            await conn.close()
            self.parts.tracing.shutdown()
            raise
        self._conn, self._plan, self._summary, self._started = conn, plan, summary, True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._started:
                await self.parts.publisher.close()
        finally:
            self._started = False
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            self.parts.tracing.shutdown()  # the spans still buffered reach the collector

    async def check_destinations(self) -> list[DestinationCheck] | None:
        """What the publisher finds of its destinations (None when its broker has none to
        look at), as `relay replay --dry-run` prints them."""
        return await check_destinations(self.parts.publisher)

    async def require_destinations(self) -> None:
        """:class:`relay.ConfigError` naming a destination that is known absent (missing
        or unreachable), before anything is sent; :meth:`run` asks this itself."""
        if self._destinations_there:
            return
        absent = [c for c in await self.check_destinations() or () if c.known_absent]
        if absent:
            more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise ConfigError(
                f"cannot replay to {absent[0].describe()}{more}; nothing was published"
                " (create it, or correct --to, the routes or the routing key)"
            )
        self._destinations_there = True

    async def run(
        self, stop: asyncio.Event | None = None, *, progress: Callable[[ReplayReport], None] | None = None
    ) -> ReplayReport:
        """Replay the plan until done (or ``stop`` is set: what is being published is
        finished first); ``progress`` is called as messages settle. Refuses, before any
        send, a destination that is known absent: the replay would wait for it for ever (an
        outage spends nothing)."""
        if self._plan is None or self._summary is None:
            raise RuntimeError("enter the Replay (async with) before running it")
        await self.require_destinations()
        replayer = Replayer(
            self._plan,
            self.parts.publisher,
            self.run_id,
            self.parts.limits,
            progress=progress,
            tracing=self.parts.tracing,
            skip_failed=self.skip_failed,
        )
        return await replayer.run(self._summary.count, stop or asyncio.Event(), first_id=self._summary.first_id)


def left_out_line(summary: PlanSummary) -> str:
    """What the selection took and the plan leaves out, and how to have it: '' for nothing."""
    left = summary.left_out
    parts = []
    if left.skipped:
        parts.append(f"{count_of(left.skipped, 'message')} an operator skipped (--include-skipped replays them)")
    if left.dead:
        parts.append(f"{count_of(left.dead, 'dead message')} (--include-dead replays them)")
    if left.excluded:
        parts.append(f"{count_of(left.excluded, 'message')} named by --exclude")
    return "left out: " + "; ".join(parts) if parts else ""
