"""Running the console: its pool, the sampler behind the chart, and the HTTP server, until
SIGTERM or Ctrl-C."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from relay.compose import checked_pool
from relay.console.app import Console, ConsoleConfig, make_app, make_index
from relay.console.auth import Guard, Token
from relay.console.history import History, sample_forever
from relay.console.hosts import is_loopback
from relay.db.names import OutboxNames
from relay.db.session import open_pool
from relay.errors import ConfigError
from relay.summary import StatusSummary, read_summary

log = logging.getLogger("relay.console")

POOL_SIZE = 3  # page reads and the sampler; actions are a few statements each


@dataclass(frozen=True)
class ServeOptions:
    dsn: str
    host: str
    port: int  # 0: any free port (the log line says which)
    tokens: tuple[Token, ...]
    window: timedelta
    sample_every: timedelta


async def serve(config: ConsoleConfig, options: ServeOptions, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set, or SIGTERM/SIGINT when no ``stop`` is given."""
    pool = await checked_pool(options.dsn, config.names, POOL_SIZE)
    history = History(options.window)
    stop = stop or _stop_on_signals()
    console = Console(config, pool, history, Guard(options.tokens))
    sampler = start_sampling(pool, config.names, history, options.sample_every, stop)
    try:
        await _serve(make_app(console), config, options, stop, f"outbox {config.names.qualified} on {config.where}")
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await pool.close()


async def serve_outboxes(
    outboxes: Sequence[tuple[ConsoleConfig, str]], options: ServeOptions, stop: asyncio.Event | None = None
) -> None:
    """A console of several outboxes (each a config and its DSN): an index at ``/``, each
    outbox's pages under ``/o/<name>/`` (relay.console.app.make_index). An outbox whose
    database cannot be reached says so on the index and its pages; the others serve."""
    stop = stop or _stop_on_signals()
    guard = Guard(options.tokens)  # one sign-in: the tokens are the process's
    consoles: list[Console] = []
    samplers: list[asyncio.Task[None]] = []
    try:
        for config, dsn in outboxes:
            pool = await open_pool(dsn, POOL_SIZE, least=1, probe=False)
            console = Console(config, pool, History(options.window), guard)
            consoles.append(console)
            samplers.append(start_sampling(pool, config.names, console.history, options.sample_every, stop))
        first = outboxes[0][0]
        await _serve(make_index(consoles), first, options, stop, f"{len(consoles)} outboxes (index at /)")
    finally:
        for sampler in samplers:
            sampler.cancel()
        await asyncio.gather(*samplers, return_exceptions=True)
        for console in consoles:
            await console.pool.close()


async def _serve(
    app: web.Application, config: ConsoleConfig, options: ServeOptions, stop: asyncio.Event, what: str
) -> None:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, options.host, options.port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {options.host}:{options.port}: {exc.strerror or exc}") from None
        port = _bound_port(runner, options.port)
        shown_host = f"[{options.host}]" if ":" in options.host else options.host
        log.info(
            "console at http://%s:%d/ for %s; actions %s",
            shown_host,
            port,
            what,
            "on" if config.allow_actions else "off (--allow-actions to enable)",
        )
        if not is_loopback(options.host):
            log.warning(
                "console bound to %s, beyond this host: put it behind a proxy that terminates TLS, or tokens and"
                " pages cross the network in clear text",
                options.host,
            )
        if config.allowed_hosts is None:
            log.warning(
                "console answers to any Host name on a wildcard address: name the ones it is reached by with"
                " --allow-host, or a page on another site can read it through DNS rebinding"
            )
        await stop.wait()
    finally:
        await runner.cleanup()


def start_sampling(
    pool: AsyncConnectionPool[Any], names: OutboxNames, history: History, every: timedelta, stop: asyncio.Event
) -> asyncio.Task[None]:
    """The task that feeds ``history`` from ``names``' status every ``every`` until ``stop``."""

    async def read() -> StatusSummary:
        async with pool.connection() as conn:
            return await read_summary(conn, names)

    return asyncio.create_task(sample_forever(history, read, every, stop))


def _bound_port(runner: web.AppRunner, asked: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return asked


def _stop_on_signals() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
