"""RabbitMQ through aio-pika: :meth:`relay.Consumer.run_rabbitmq`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from relay.consumers.verdict import Applier, settles
from relay.inbox import received_from_aio_pika

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

log = logging.getLogger("relay.consumers.rabbitmq")


async def consume(consumer: Applier, queue: AbstractQueue) -> None:
    # aio-pika runs each delivery's callback as a task of its own: kept here so that a
    # cancelled run lets them finish (their acknowledgements go out) before it returns.
    inflight: set[asyncio.Task[Any]] = set()

    async def on_message(message: AbstractIncomingMessage) -> None:
        task = asyncio.current_task()
        if task is not None:
            inflight.add(task)
        try:
            await handle(consumer, message)
        finally:
            if task is not None:
                inflight.discard(task)

    tag = await queue.consume(on_message)
    try:
        await asyncio.Future()
    finally:
        with contextlib.suppress(Exception):
            await queue.cancel(tag)
        if inflight:
            await asyncio.wait(inflight)


async def handle(consumer: Applier, message: AbstractIncomingMessage) -> None:
    """One delivery: acknowledged once its event is applied (committed) or a duplicate."""
    try:
        event = received_from_aio_pika(message)
    except ValueError as exc:
        log.warning("message %s rejected without requeue, not one the relay sent: %s", message.message_id, exc)
        await _settle(message.reject(requeue=False), message)
        return
    settled = await settles(consumer, event, log, "requeued")
    if settled:
        await _settle(message.ack(), message)
        return
    await asyncio.sleep(consumer.retry_delay.total_seconds())
    await _settle(message.reject(requeue=True), message)


async def _settle(answer: Awaitable[Any], message: AbstractIncomingMessage) -> None:
    try:
        await answer
    except Exception as exc:  # the channel closed meanwhile
        # Unacknowledged, it comes again: the inbox answers duplicate then.
        log.warning("message %s: the broker did not take the answer (%s); it will come again", message.message_id, exc)
