"""The ``log`` broker: writes one JSON line per message to stdout. For trying the relay
out and for piping into other tools; it confirms every message it has written."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TextIO

from adapters.base import Outcome
from relay.errors import BrokerUnavailable
from relay.message import OutboxMessage


class LogPublisher:
    name = "log"

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._stream.flush()

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]:
        lines = []
        for m in batch:
            envelope: dict[str, object] = {
                "outbox_id": m.id,
                "aggregate_type": m.aggregate_type,
                "aggregate_id": m.aggregate_id,
                "event_type": m.event_type,
                "attempt": m.attempt,
                "lease_version": m.lease_version,
            }
            if m.aggregate_seq is not None:
                envelope["aggregate_seq"] = m.aggregate_seq
            # The payload is already JSON text; splice it in rather than decode and re-encode.
            lines.append(json.dumps(envelope)[:-1] + ', "payload": ' + m.body.decode() + "}\n")
        try:
            self._stream.write("".join(lines))
            self._stream.flush()
        except OSError as exc:  # the reader went away (a closed pipe): nothing was delivered
            return [BrokerUnavailable(f"stdout is not writable: {exc}")] * len(batch)
        return [None] * len(batch)


OPTIONS: tuple[()] = ()


def create(values: object) -> LogPublisher:
    return LogPublisher()
