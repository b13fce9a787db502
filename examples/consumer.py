"""An aio-pika consumer that applies each order event exactly once, in order per order, into
its own database with `relay.Consumer` and `relay.Inbox`.

Up to 50 messages are handled at once (the channel's prefetch), each on a connection of
its own from a pool and in a transaction of its own: the inbox's receipt and the effect
commit together, and the message is acknowledged only after that commit. A duplicate is
acknowledged and skipped; an event that comes before an earlier one of its order is
requeued half a second later (the inbox holds each order's events to their order, so
concurrency never reorders them). Kill it at any moment: what was not acknowledged comes
again, and what had committed is then a duplicate.

    make example-consumer            # database outbox_relay_example_consumer

EXAMPLE_DSN, EXAMPLE_AMQP_URL and EXAMPLE_EXCHANGE say where (examples/common.py);
EXAMPLE_CONSUMER_DATABASE and EXAMPLE_QUEUE name its database and queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import aio_pika
import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from examples.common import AMQP_URL, EXCHANGE, database
from relay import Consumer, Inbox, Received

log = logging.getLogger("example.consumer")
QUEUE = os.environ.get("EXAMPLE_QUEUE", "outbox-example-orders")
DATABASE = os.environ.get("EXAMPLE_CONSUMER_DATABASE", "outbox_relay_example_consumer")
# Messages in flight at once (the channel's prefetch). Each takes a pooled connection for
# its transaction; POOL_SIZE of them run at a time and the others wait for a connection,
# so a consumer never holds more connections than that, however large the prefetch.
PREFETCH = 50
POOL_SIZE = 10

TABLES = """
CREATE TABLE IF NOT EXISTS order_view (
    order_id bigint PRIMARY KEY,
    status   text    NOT NULL,
    version  integer NOT NULL
);
-- Every event applied, in the order applied. No unique key: an event applied twice would
-- show twice (tests/test_consumer_example.py counts on it).
CREATE TABLE IF NOT EXISTS order_log (
    applied       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id      uuid   NOT NULL,
    order_id      text   NOT NULL,
    event_type    text   NOT NULL,
    aggregate_seq bigint,
    payload       jsonb  NOT NULL
);
"""


# --8<-- [start:handler]
async def apply_order_event(conn: psycopg.AsyncConnection[Any], event: Received) -> None:
    """The effect of one new event, on the connection and in the transaction in which
    relay.Consumer records it: both commit, or neither."""
    payload = event.payload()
    await conn.execute(
        "INSERT INTO order_log (event_id, order_id, event_type, aggregate_seq, payload) VALUES (%s, %s, %s, %s, %s)",
        (event.event_id, event.aggregate_id, event.event_type, event.aggregate_seq, Jsonb(payload)),
    )
    if event.event_type in ("OrderPlaced", "OrderPaid"):
        await conn.execute(
            "INSERT INTO order_view (order_id, status, version) VALUES (%s, %s, %s)"
            " ON CONFLICT (order_id) DO UPDATE SET status = excluded.status, version = excluded.version",
            (payload["order_id"], "paid" if event.event_type == "OrderPaid" else "placed", payload["version"]),
        )
    log.info("applied %s of order %s (aggregate_seq %s)", event.event_type, event.aggregate_id, event.aggregate_seq)


# --8<-- [end:handler]


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dsn = database(DATABASE)
    # --8<-- [start:run]
    inbox = Inbox()  # public.inbox and public.inbox_aggregates
    with psycopg.connect(dsn) as setup:
        inbox.migrate(setup)  # at every start: creates what is absent, replaces the function
        setup.execute(TABLES)
    async with (
        AsyncConnectionPool(dsn, min_size=2, max_size=POOL_SIZE, open=False) as pool,
        await aio_pika.connect_robust(AMQP_URL) as rabbit,
    ):
        channel = await rabbit.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        exchange = await channel.declare_exchange(EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(QUEUE, durable=True)
        await queue.bind(exchange, "#")
        log.info("consuming %s (exchange %s), %d at a time; Ctrl-C stops", QUEUE, EXCHANGE, PREFETCH)
        await Consumer(pool, inbox, apply_order_event).run_rabbitmq(queue)
    # --8<-- [end:run]


if __name__ == "__main__":
    asyncio.run(main())
