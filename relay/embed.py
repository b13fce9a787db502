"""The relay inside an application's own asyncio process (a FastAPI lifespan, a worker).

::

    from relay import Relay

    async with Relay(dsn="postgresql://relay@db/app", broker="rabbitmq",
                     amqp_url="amqp://guest:guest@rabbit/", exchange="events", workers=2):
        ...  # the application runs; the relay delivers beside it

The settings are `relay start`'s options, named as their flags without the dashes
(``--batch-size 50`` is ``batch_size=50``; durations as ``timedelta``, seconds or text such
as ``"30s"``; lists as lists), and go through the same validation: a bad one raises
:class:`relay.ConfigError` naming the flag, before anything starts. RELAY_* variables and
a config file are read only when asked (``environ=os.environ``, ``config="relay.toml"``).
`relay start` itself runs through this class.

Entering ``async with Relay(...)`` (or ``await relay.start()``) returns once the relay is
connected to PostgreSQL and the broker and has checked the outbox's schema and the
destinations, and raises the relay's one-line reason otherwise (:class:`relay.ConfigError`
for a login the broker refuses or an outbox not migrated, ``DatabaseUnavailable`` for a
database that cannot be reached), so an application's start-up fails with it.

Leaving the ``async with`` (or :meth:`Relay.stop`) stops as SIGTERM stops `relay start`:
the workers finish the batch in hand within ``shutdown_grace``; what is still publishing
then is handed back without spending an attempt. Cancelling the task that runs the relay
(:meth:`run`, or the block's own task) stops it at once: every task it started ends, the
rows in flight are handed back unspent, and the CancelledError goes on. An error that
stops a started relay later (a worker's bug) is logged at ERROR when it happens, and
raised from the ``async with`` block's exit (from :meth:`wait`); :attr:`failed` tells
meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, Unpack

from relay.compose import compose_outboxes, compose_start
from relay.contract import Publisher
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, first_line
from relay.options_typed import RelayOptions
from relay.shared_settings import Given
from relay.tracing import Tracing

__all__ = ["Relay"]

log = logging.getLogger("relay.embed")


class Relay:
    """Runs `relay start`'s workers in the running event loop.

    :param settings: `relay start`'s options by their flag's name (``dsn``, ``broker``,
        ``workers``, ``exchange``, ``queue_url``, ...), typed by
        :class:`relay.options_typed.RelayOptions`; ``log_level`` and ``log_format`` are not
        applied (the application configures logging).
    :param environ: read RELAY_* variables from this mapping (``os.environ``), below the
        settings given here; none by default.
    :param config: a TOML config file, below both.
    :param publisher: a publisher of your own (relay.testing's in-memory one, a destination
        you have not installed as a package), used instead of the one ``broker`` names;
        ``broker`` and its settings are not read then.
    :param outboxes: several outboxes for one relay: one mapping each, with a ``name``
        and the settings that are its own (``dsn``, ``schema``, ``table``, ``exchange``,
        ``workers``, ...); the other settings given here are every outbox's defaults. The
        config file's ``[[outboxes]]`` does the same (docs/outboxes.md). With several
        outboxes, :meth:`start` returns once each delivers or has been found held (at most
        10 s): one outbox whose database or schema is wrong is held, logged and started
        again, never raised, so that the others deliver.
    """

    def __init__(
        self,
        *,
        environ: Mapping[str, str] | None = None,
        config: str | None = None,
        publisher: Publisher | None = None,
        outboxes: Sequence[Mapping[str, Any]] | None = None,
        **settings: Unpack[RelayOptions],
    ) -> None:
        fleet = compose_outboxes(settings, environ=environ, config=config, outboxes=outboxes, publisher=publisher)
        self._fleet = fleet
        if fleet is None:
            first = compose_start(settings, environ=environ, config=config, publisher=publisher)
        else:
            first = fleet.outboxes[0].parts
        # With several outboxes: the first one's (each has its own; see outboxes).
        self.settings = first.settings
        self.operations = first.operations if fleet is None else fleet.operations
        self.log = first.log if fleet is None else fleet.log
        self._given: tuple[Given, ...] = first.given
        self._publisher = first.publisher
        self._tracing: Tracing = first.tracing if fleet is None else fleet.tracing
        self._ran = False
        self._stop = asyncio.Event()
        # Set by the run once it is connected and checked (relay.runner.run_relay).
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def outboxes(self) -> tuple[str, ...]:
        """The names of the outboxes this relay serves (``()``: the one its settings name)."""
        return () if self._fleet is None else tuple(o.name for o in self._fleet.outboxes)

    async def run(self) -> None:
        """Deliver until :meth:`stop`; raises what stopped the relay otherwise. Once per
        Relay (its broker connection is closed when it returns). Cancelling the task that
        runs it stops the relay at once and cleanly (see the module's docstring)."""
        if self._ran:
            raise RuntimeError("a Relay runs once; make a new one")
        self._ran = True
        try:
            if self._fleet is not None:
                from relay.fleet import run_fleet

                await run_fleet(self._fleet, self._stop, ready=self._ready)
                return
            from relay.runner import run_relay

            await run_relay(
                self.settings,
                self._publisher,
                self._stop,
                operate=self.operations,
                given=self._given,
                tracing=self._tracing,
                ready=self._ready,
            )
        finally:
            self._tracing.shutdown()  # the spans still buffered reach the collector

    async def start(self) -> None:
        """Run the relay as a task of the running event loop, and return once it is
        connected to PostgreSQL and the broker and has checked the outbox and the
        destinations (a destination that is missing is logged and waited for, not an
        error). Raises what stopped it before that: a :class:`relay.ConfigError` (the
        broker refused the login, the outbox is not migrated, ...) or a
        ``DatabaseUnavailable``, each one line. Stop it with :meth:`stop` and
        :meth:`wait`, or use ``async with``, which does all three."""
        if self._task is not None:
            raise RuntimeError("this Relay is already running")
        what = self.settings.names.qualified if self._fleet is None else f"{len(self.outboxes)} outboxes"
        task = asyncio.get_running_loop().create_task(self.run(), name=f"outbox-relay {what}")
        self._task = task
        ready = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The application's start-up was cancelled: the relay goes with it, cleanly.
            self._task = None
            task.cancel()
            await asyncio.wait([task])
            raise
        finally:
            ready.cancel()
        if not self._ready.is_set():  # it ended before it was ready: raise why
            self._task = None
            task.result()  # what stopped it, or nothing when stop() came first
            return
        # From now on nobody awaits the task until the application stops it: an error
        # would stay silent until then, so it is logged the moment it happens.
        task.add_done_callback(_log_failure)

    async def wait(self) -> None:
        """Wait until a relay started with :meth:`start` has stopped (after :meth:`stop`,
        or an error); raises the error that stopped it."""
        task, self._task = self._task, None
        if task is not None:
            await task

    def stop(self) -> None:
        """Ask the relay to stop (as SIGTERM does `relay start`); :meth:`run` then returns."""
        self._stop.set()

    @property
    def failed(self) -> BaseException | None:
        """What stopped a relay started with ``async with`` or :meth:`start`, while it is
        still inside it."""
        task = self._task
        if task is None or not task.done() or task.cancelled():
            return None
        return task.exception()

    async def __aenter__(self) -> Relay:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        try:
            await self.wait()
        except asyncio.CancelledError:
            raise
        except Exception:
            if exc is None:
                raise
            # The block's own exception goes on; the relay's was logged when it happened.


def _log_failure(task: asyncio.Task[None]) -> None:
    """A started relay's error, logged when it stops the relay (masked: an application's
    handlers may not mask as `relay start`'s do)."""
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        return
    expected = isinstance(error, ConfigError | DatabaseUnavailable)
    log.error(
        "the relay stopped: %s",
        mask(first_line(error)) if expected else f"{type(error).__name__}: {mask(first_line(error))}",
        exc_info=None if expected else error,
    )
