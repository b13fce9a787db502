"""SQS (and SNS to SQS) through boto3: :meth:`relay.Consumer.run_sqs`. boto3 blocks, so
each call runs in a thread; its clients are thread-safe."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any

from relay.consumers.verdict import BROKER_PAUSE_S, Applier, settles
from relay.inbox import received_from_sns, received_from_sqs

log = logging.getLogger("relay.consumers.sqs")


async def consume(consumer: Applier, client: Any, queue_url: str, *, sns: bool, batch: int, wait_seconds: int) -> None:
    read = received_from_sns if sns else received_from_sqs
    while True:
        try:
            answer = await asyncio.to_thread(
                client.receive_message,
                QueueUrl=queue_url,
                MaxNumberOfMessages=batch,
                WaitTimeSeconds=wait_seconds,
                MessageAttributeNames=["All"],
            )
        except Exception as exc:  # the service unreachable, throttling: the queue keeps the messages
            log.warning("receiving from %s failed (%s); again in %s s", queue_url, exc, BROKER_PAUSE_S)
            await asyncio.sleep(BROKER_PAUSE_S)
            continue
        messages = answer.get("Messages") or []
        await asyncio.gather(*(handle(consumer, client, queue_url, m, read) for m in messages))


async def handle(consumer: Applier, client: Any, queue_url: str, message: Mapping[str, Any], read: Any) -> None:
    """One message: deleted once its event is applied (committed) or a duplicate."""
    receipt = message["ReceiptHandle"]
    try:
        event = read(message)
    except ValueError as exc:
        # No "reject" in SQS: it comes back after the visibility timeout, until the
        # queue's redrive policy moves it to the dead-letter queue.
        log.warning("message %s left to the redrive policy, not one the relay sent: %s", message.get("MessageId"), exc)
        return
    settled = await settles(consumer, event, log, "visible again")
    try:
        if settled:
            await asyncio.to_thread(client.delete_message, QueueUrl=queue_url, ReceiptHandle=receipt)
        else:
            # Whole seconds: SQS's unit. At least 1, so that a short delay still waits.
            delay = max(1, math.ceil(consumer.retry_delay.total_seconds()))
            await asyncio.to_thread(
                client.change_message_visibility, QueueUrl=queue_url, ReceiptHandle=receipt, VisibilityTimeout=delay
            )
    except Exception as exc:  # an expired receipt handle, the service unreachable
        log.warning("message %s: SQS did not take the answer (%s); it will come again", message.get("MessageId"), exc)
