"""`relay start`: deliver outbox rows to the broker until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import click

from relay import logs
from relay.cli.common import with_options
from relay.embed import Relay
from relay.wiring import START_ALL

__all__ = ["START_ALL", "start_cmd"]


@click.command("start")
@with_options(START_ALL)
def start_cmd(**cli_values: Any) -> None:
    """Deliver outbox rows to the broker until SIGINT or SIGTERM."""
    config_path = cli_values.pop("config_path", None)
    # The same entry point an application embeds (relay.Relay): the same options, the same
    # validation; the command adds the environment, the config file, logging and signals.
    relay = Relay(environ=os.environ, config=config_path, **{k: v for k, v in cli_values.items() if v != ()})
    logs.configure(relay.log.level, relay.log.format)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        signals = {"count": 0}

        def on_signal() -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                # A second signal means "now": leases return every claimed row.
                os._exit(130)
            relay.stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await relay.run()

    asyncio.run(run())
