"""A consumer for tests/test_pipeline_inbox.py, run in its own process (and killed now and
then): aio-pika with manual acknowledgement, ``relay.Inbox`` in its own database, and each
event's effect a row of ``effects`` written in the same transaction as the receipt.

``effects`` has no unique key on purpose: an effect applied twice shows as two rows, and
its ``applied`` column (a sequence) is the order the effects were applied in.

Settings from the environment: CONSUMER_DSN, CONSUMER_SCHEMA, CONSUMER_AMQP_URL,
CONSUMER_QUEUE.
"""

from __future__ import annotations

import asyncio
import os
import sys

import aio_pika
import psycopg
from psycopg import sql

from relay import Inbox, OutOfOrder, received_from_aio_pika

SCHEMA = os.environ["CONSUMER_SCHEMA"]


async def main() -> None:
    inbox = Inbox("inbox", SCHEMA)
    conn = await psycopg.AsyncConnection.connect(os.environ["CONSUMER_DSN"])
    rabbit = await aio_pika.connect(os.environ["CONSUMER_AMQP_URL"])
    channel = await rabbit.channel()
    await channel.set_qos(prefetch_count=30)
    queue = await channel.get_queue(os.environ["CONSUMER_QUEUE"], ensure=True)
    insert = sql.SQL(
        "INSERT INTO {}.effects (ref, aggregate_id, event_type, version, event_id) VALUES (%s, %s, %s, %s, %s)"
    ).format(sql.Identifier(SCHEMA))
    lock = asyncio.Lock()  # one connection: one transaction at a time

    async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        event = received_from_aio_pika(message)
        try:
            async with lock, conn.transaction():
                if await inbox.receive_async(conn, event):
                    body = event.payload()
                    await conn.execute(
                        insert, (body["ref"], event.aggregate_id, event.event_type, body["version"], event.event_id)
                    )
        except OutOfOrder:
            await asyncio.sleep(0.05)
            await message.reject(requeue=True)
            return
        await message.ack()

    await queue.consume(handle)
    print("consuming", flush=True)
    await asyncio.Future()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
