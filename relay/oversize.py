"""One message over the batch byte budget in flight per relay process at a time.

A claim takes rows while their payloads fit ``--batch-bytes``, but a message larger than
the budget would then never be claimed, so a claim may take one such message, alone.
Were every worker to hold one at once, a process would hold ``workers`` of them, each
several times over while it is read and published (the driver's buffers, the broker
client's frames): twenty 10 MB payloads, four at a time, took a 4-worker relay to
181 MiB. So the workers of a process take turns: the worker holding the turn may claim
an oversized message; the others pass such rows over and go on with the rest.
"""

from __future__ import annotations


class OversizeTurn:
    """Which worker of the process may hold a message over the budget (asyncio, one thread)."""

    def __init__(self) -> None:
        self._holder: str | None = None

    def take(self, worker: str) -> bool:
        """Take the turn if it is free (or already ours); never waits."""
        if self._holder is None:
            self._holder = worker
        return self._holder == worker

    def release(self, worker: str) -> None:
        if self._holder == worker:
            self._holder = None

    @property
    def holder(self) -> str | None:
        return self._holder
