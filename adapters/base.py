"""The publisher contract every broker adapter implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from relay.message import OutboxMessage

# One outcome per message: None when the broker confirmed it, otherwise the failure-class
# exception (relay.RetryableError, PermanentError, Defer or BrokerUnavailable) saying why.
Outcome = BaseException | None


class Publisher(Protocol):
    """Delivers batches of outbox messages to a broker.

    Contract:

    - ``publish`` takes a batch and returns exactly one outcome per message, in the same
      order. It returns, rather than raises, per-message failures, so that brokers that
      batch (SQS) and brokers that confirm one by one (RabbitMQ) fit the same loop. If it
      raises, the exception is taken as the outcome of every message in the batch.
    - A message counts as delivered (None) only once the broker has confirmed it.
    - SDK exceptions never leave the adapter: they are translated into the failure classes.
      Anything else reaching the relay is treated as an adapter bug (dead, not retried).
    - Within a batch there is at most one ordered message per aggregate (the ordered claim
      leases only heads), so an adapter may publish a whole batch concurrently.
    - The relay cancels ``publish`` when the publish timeout passes; everything still
      unconfirmed then counts as retryable, since the broker may or may not have it.
    - ``publish`` may be called from several workers of one process concurrently.
    - ``start`` connects (and fails fast, with a one-line ``relay.ConfigError``, on settings
      no retry can fix, such as wrong credentials); ``close`` waits for nothing in flight
      to be lost and releases the connection.
    """

    name: str

    async def start(self) -> None: ...

    async def publish(self, batch: Sequence[OutboxMessage]) -> Sequence[Outcome]: ...

    async def close(self) -> None: ...
