"""Kafka through aiokafka: :meth:`relay.Consumer.run_kafka`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from relay.consumers.verdict import BROKER_PAUSE_S, Applier, settles
from relay.inbox import received_from_kafka

log = logging.getLogger("relay.consumers.kafka")


async def consume(consumer: Applier, kafka: Any) -> None:
    while True:
        try:
            batches = await kafka.getmany(timeout_ms=1000)
        except Exception as exc:  # a broker unreachable, a rebalance: the log keeps the records
            log.warning("fetching failed (%s); again in %s s", exc, BROKER_PAUSE_S)
            await asyncio.sleep(BROKER_PAUSE_S)
            continue
        await asyncio.gather(*(partition(consumer, kafka, tp, records) for tp, records in batches.items()))


async def partition(consumer: Applier, kafka: Any, tp: Any, records: list[Any]) -> None:
    """One partition's fetch: each key's records in offset order (the relay keys by
    aggregate), keys concurrently; then the offset past them all."""
    by_key: dict[Any, list[Any]] = {}
    for record in records:
        by_key.setdefault(record.key, []).append(record)
    from aiokafka.errors import IllegalOperation

    applied = await asyncio.gather(*(in_order(consumer, kafka, tp, mine) for mine in by_key.values()))
    if not all(applied):
        return  # revoked meanwhile: its new owner reads from the last commit
    try:
        await kafka.commit({tp: records[-1].offset + 1})
    except IllegalOperation:  # no group_id: nothing to commit to (the caller keeps positions)
        pass
    except Exception as exc:  # a rebalance took the partition
        # Read again by whoever has it now: the inbox answers duplicate for what committed here.
        log.warning("offset %s of %s not committed (%s); it will be read again", records[-1].offset + 1, tp, exc)


async def in_order(consumer: Applier, kafka: Any, tp: Any, records: list[Any]) -> bool:
    """False when the partition was taken away before all of ``records`` applied."""
    for record in records:
        try:
            event = received_from_kafka(record)
        except ValueError as exc:
            log.warning("record %s of %s skipped, not one the relay sent: %s", record.offset, tp, exc)
            continue
        while True:
            if await settles(consumer, event, log, "retried"):
                break
            await asyncio.sleep(consumer.retry_delay.total_seconds())
            if tp not in kafka.assignment():
                return False
    return True
