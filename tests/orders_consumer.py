"""A consumer for tests/test_pipeline_inbox.py, run in its own process (and killed now and
then): ``relay.Consumer`` on an aio-pika queue with a prefetch of 50, a connection per
message from a pool, ``relay.Inbox`` in its own database, and each event's effect a row of
``effects`` (with the ``aggregate_seq`` the event came with) written in the same
transaction as the receipt.

``effects`` has no unique key on purpose: an effect applied twice shows as two rows, and
its ``applied`` column (a sequence) is the order the effects were applied in.

Settings from the environment: CONSUMER_DSN, CONSUMER_SCHEMA, CONSUMER_AMQP_URL,
CONSUMER_QUEUE.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import aio_pika
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay import Consumer, Inbox, Received

SCHEMA = os.environ["CONSUMER_SCHEMA"]
INSERT = sql.SQL(
    "INSERT INTO {}.effects (ref, aggregate_id, event_type, version, aggregate_seq, event_id)"
    " VALUES (%s, %s, %s, %s, %s, %s)"
).format(sql.Identifier(SCHEMA))


async def record(conn: psycopg.AsyncConnection[Any], event: Received) -> None:
    body = event.payload()
    await conn.execute(
        INSERT,
        (body["ref"], event.aggregate_id, event.event_type, body["version"], event.aggregate_seq, event.event_id),
    )


async def main() -> None:
    dsn = os.environ["CONSUMER_DSN"]
    async with (
        AsyncConnectionPool(dsn, min_size=1, max_size=10, open=False) as pool,
        await aio_pika.connect(os.environ["CONSUMER_AMQP_URL"]) as rabbit,
    ):
        channel = await rabbit.channel()
        await channel.set_qos(prefetch_count=50)
        queue = await channel.get_queue(os.environ["CONSUMER_QUEUE"], ensure=True)
        print("consuming", flush=True)
        await Consumer(pool, Inbox("inbox", SCHEMA), record, retry_delay="50ms").run_rabbitmq(queue)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
