"""An aio-pika consumer that applies each order event exactly once, in order per order, with
`relay.Inbox` in its own database: the receipt and the effect (a row in `order_view`)
commit together; a duplicate is acknowledged and skipped; an event that comes before an
earlier one of its order is requeued after a pause.

    make example-consumer            # database outbox_relay_example_consumer
"""

from __future__ import annotations

import asyncio
import logging

import aio_pika
import psycopg

from examples.common import AMQP_URL, EXCHANGE, database
from relay import Inbox, OutOfOrder, received_from_aio_pika

log = logging.getLogger("example.consumer")
QUEUE = "outbox-example-orders"


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    dsn = database("outbox_relay_example_consumer")
    inbox = Inbox()
    with psycopg.connect(dsn) as setup:
        inbox.migrate(setup)
        setup.execute(
            "CREATE TABLE IF NOT EXISTS order_view (order_id bigint PRIMARY KEY, status text NOT NULL,"
            " version integer NOT NULL, events integer NOT NULL DEFAULT 1)"
        )
    conn = await psycopg.AsyncConnection.connect(dsn)
    rabbit = await aio_pika.connect_robust(AMQP_URL)
    channel = await rabbit.channel()
    await channel.set_qos(prefetch_count=20)
    exchange = await channel.declare_exchange(EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(QUEUE, durable=True)
    await queue.bind(exchange, "#")

    async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            event = received_from_aio_pika(message)
        except ValueError as exc:  # not a message the relay sent (or one from before 0015)
            log.warning("message %s rejected: %s", message.message_id, exc)
            await message.reject(requeue=False)  # to the queue's dead-letter exchange, if it has one
            return
        try:
            async with conn.transaction():
                if await inbox.receive_async(conn, event):
                    payload = event.payload()
                    status = "paid" if event.event_type == "OrderPaid" else "placed"
                    await conn.execute(
                        "INSERT INTO order_view (order_id, status, version) VALUES (%s, %s, %s)"
                        " ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, version = excluded.version,"
                        " events = order_view.events + 1",
                        (payload["order_id"], status, payload["version"]),
                    )
                    log.info("applied %s of order %s (aggregate_seq %s)", event.event_type, event.aggregate_id,
                             event.aggregate_seq)  # fmt: skip
                else:
                    log.info("duplicate %s skipped", event.event_id)
        except OutOfOrder as exc:
            log.info("%s; requeued", exc)
            await asyncio.sleep(0.5)
            await message.reject(requeue=True)
            return
        await message.ack()

    await queue.consume(handle)
    log.info("consuming %s (exchange %s); Ctrl-C stops", QUEUE, EXCHANGE)
    try:
        await asyncio.Future()
    finally:
        await rabbit.close()
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
