"""The publisher contract: what the core asks of every broker adapter, and what it tells
one when it builds it.

The core owns this contract; adapters (``adapters/``) import it, never the reverse. The
core reaches a concrete adapter only through :mod:`adapters.registry`, which the CLI calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from relay.errors import RetryableError
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


# The brokers `--broker` accepts. Each is the adapter module of that name under adapters/
# (adapters.registry imports it when it is chosen); adding a broker adds its name here.
BROKERS = ("sqs", "sns", "rabbitmq", "log")


@runtime_checkable
class WatchesDestinations(Protocol):
    """An optional ability (detected when needed): a publisher over several destinations
    that reports each one's health, ``on_change(destination, is_open)``, for the metrics."""

    def watch_destinations(self, on_change: Callable[[str, bool], None]) -> None: ...


# The core's default for --publish-timeout, for adapters' own defaults derived from it.
DEFAULT_PUBLISH_TIMEOUT = timedelta(seconds=20)


@dataclass(frozen=True)
class PublishLimits:
    """The core settings an adapter sizes itself by, passed to it when it is built: an
    adapter never reads the core's options itself.

    :param publish_timeout: the relay cancels a batch's publish after this long, so the
        adapter's own timeouts (confirms, SDK calls) should end inside it.
    :param workers: dispatch loops that may call ``publish`` at once.
    :param batch_size: messages one ``publish`` receives at most.
    """

    publish_timeout: timedelta
    workers: int
    batch_size: int


# The RetryableError of a publish that ran out of time starts with this.
TIMEOUT_PREFIX = "publish timed out"


async def publish_within(publisher: Publisher, messages: Sequence[OutboxMessage], deadline_s: float) -> list[Outcome]:
    """``publisher.publish(messages)`` held to the contract, for every caller (the
    workers, relay replay): one outcome per message whatever happens. Past ``deadline_s``
    the publish is cancelled and every message counts as retryable (the broker may or may
    not have it; consumers de-duplicate by id); an exception is every message's outcome;
    a wrong number of outcomes is an adapter bug, the outcome of them all."""
    try:
        async with asyncio.timeout(deadline_s):
            outcomes = list(await publisher.publish(messages))
    except TimeoutError:
        return [RetryableError(f"{TIMEOUT_PREFIX} after {deadline_s:g}s")] * len(messages)
    except Exception as exc:  # the adapter raised for the whole batch
        return [exc] * len(messages)
    if len(outcomes) != len(messages):
        bug = RuntimeError(
            f"publisher {publisher.name!r} returned {len(outcomes)} outcomes for {len(messages)} messages"
        )
        return [bug] * len(messages)
    return outcomes
