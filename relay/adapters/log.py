"""The ``log`` broker: writes one JSON line per message to stdout. For trying the relay
out and for piping into other tools; it confirms every message it has written."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from relay.contract import DestinationSpec, Outcome, PublishLimits
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
        chunks: list[bytes] = []
        for m in batch:
            envelope = m.envelope()
            # The payload is already JSON text: spliced in as the bytes the claim got,
            # never decoded, re-encoded or joined into one string (each a copy of it).
            chunks += (json.dumps(envelope)[:-1].encode() + b', "payload": ', m.body, b"}\n")
        try:
            self._write(chunks)
        except OSError as exc:  # the reader went away (a closed pipe): nothing was delivered
            return [BrokerUnavailable(f"stdout is not writable: {exc}")] * len(batch)
        return [None] * len(batch)

    def _write(self, chunks: list[bytes]) -> None:
        binary = getattr(self._stream, "buffer", None)
        if binary is None:  # a text-only stream (tests)
            self._stream.write(b"".join(chunks).decode())
            self._stream.flush()
            return
        self._stream.flush()  # whatever was written as text goes first
        binary.writelines(chunks)  # a large chunk goes straight to the file, uncopied
        binary.flush()


@dataclass(frozen=True)
class LogSettings:
    """The log destination has no options, and nothing to size."""

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> LogSettings:
        return cls()


def _publisher(settings: LogSettings) -> LogPublisher:
    return LogPublisher()


SPEC = DestinationSpec(name="log", settings=LogSettings, publisher=_publisher)
