"""`relay start`: deliver outbox rows to the broker until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import click

from adapters.registry import max_envelope_fields
from relay import logs
from relay.cli.common import BROKER_OPTIONS, publisher_for, settings_for, with_options
from relay.config import CORE_OPTIONS, LOG_OPTIONS, OPERATE_OPTIONS, START_OPTIONS, RelaySettings
from relay.options import load_file
from relay.routes import ROUTES_OPTION
from relay.shared_settings import given_settings
from relay.tracing import tracing_for

START_ALL = (*CORE_OPTIONS, *START_OPTIONS, ROUTES_OPTION, *OPERATE_OPTIONS, *LOG_OPTIONS, *BROKER_OPTIONS)


@click.command("start")
@with_options(START_ALL)
def start_cmd(**cli_values: Any) -> None:
    """Deliver outbox rows to the broker until SIGINT or SIGTERM."""
    from relay.runner import Operations, run_relay

    config_path = cli_values.get("config_path")
    values = settings_for(START_ALL, cli_values)
    logs.configure(values["log_level"], values["log_format"])
    settings = RelaySettings.from_values(values)
    # The shared settings this process was told explicitly: compared with the stored ones
    # at start, never written (`relay settings set` changes those).
    given = given_settings(values, cli_values, load_file(config_path), os.environ)
    publisher = publisher_for(settings.broker, values, settings.publish_limits)
    # OpenTelemetry is imported here or never: without --otel this is relay.tracing's no-op.
    tracing = tracing_for(values, max_envelope_fields=max_envelope_fields(settings.broker))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        signals = {"count": 0}

        def on_signal() -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                # A second signal means "now": leases return every claimed row.
                os._exit(130)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await run_relay(settings, publisher, stop, operate=Operations.from_values(values), given=given, tracing=tracing)

    try:
        asyncio.run(run())
    finally:
        tracing.shutdown()  # the spans still buffered reach the collector
