"""NATS JetStream through nats-py: :meth:`relay.Consumer.run_nats`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from relay.consumers.verdict import BROKER_PAUSE_S, Applier, settles
from relay.inbox import received_from_nats

log = logging.getLogger("relay.consumers.nats")


async def consume(consumer: Applier, subscription: Any, *, batch: int, wait_seconds: float) -> None:
    from nats.errors import TimeoutError as FetchTimeout

    while True:
        try:
            messages = await subscription.fetch(batch, timeout=wait_seconds)
        except FetchTimeout:  # nothing within the wait: ask again
            continue
        except Exception as exc:  # the connection re-established meanwhile: the stream keeps them
            log.warning("fetching from %s failed (%s); again in %s s", subscription, exc, BROKER_PAUSE_S)
            await asyncio.sleep(BROKER_PAUSE_S)
            continue
        await asyncio.gather(*(handle(consumer, m) for m in messages))


async def handle(consumer: Applier, message: Any) -> None:
    """One message: acknowledged once its event is applied (committed) or a duplicate."""
    try:
        event = received_from_nats(message)
    except ValueError as exc:
        log.warning("message on %s terminated, not one the relay sent: %s", message.subject, exc)
        await _settle(message.term(), message)
        return
    settled = await settles(consumer, event, log, "redelivered")
    if settled:
        await _settle(message.ack(), message)
    else:
        await _settle(message.nak(delay=consumer.retry_delay.total_seconds()), message)


async def _settle(answer: Any, message: Any) -> None:
    try:
        await answer
    except Exception as exc:  # the connection dropped meanwhile
        # Unacknowledged, it comes again after ack_wait: the inbox answers duplicate then.
        log.warning("message on %s: the server did not take the answer (%s); it will come again", message.subject, exc)
