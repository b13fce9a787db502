"""A FastAPI service that places and pays orders: each request changes the `orders` table and
writes the event about it with `relay.Outbox`, in one SQLAlchemy transaction, and the relay
runs inside the same process (its lifespan) delivering the outbox to RabbitMQ.

    make example-producer            # http://127.0.0.1:8000, database outbox_relay_example
    curl -X POST localhost:8000/orders -H 'content-type: application/json' -d '{"amount": "19.90"}'
    curl -X POST localhost:8000/orders/1/pay
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from decimal import Decimal

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from examples.common import AMQP_URL, EXCHANGE, database, sqlalchemy_url
from relay import Event, Outbox, Relay

DSN = database("outbox_relay_example")
# The relay's own tables, then the service's (a real service has its own migrations).
subprocess.run([sys.executable, "-m", "relay.cli", "migrate", "--dsn", DSN], check=True)
engine = create_async_engine(sqlalchemy_url(DSN))
sessions = async_sessionmaker(engine, expire_on_commit=False)
outbox = Outbox()  # public.outbox


class NewOrder(BaseModel):
    amount: Decimal


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
                " amount numeric NOT NULL, status text NOT NULL DEFAULT 'placed', version integer NOT NULL DEFAULT 1)"
            )
        )
    async with Relay(dsn=DSN, broker="rabbitmq", amqp_url=AMQP_URL, exchange=EXCHANGE, declare=True, workers=2):
        yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


async def _place(session: AsyncSession, order: NewOrder) -> int:
    [order_id] = (
        await session.execute(text("INSERT INTO orders (amount) VALUES (:a) RETURNING id"), {"a": order.amount})
    ).one()
    placed = {"order_id": order_id, "amount": order.amount, "version": 1}
    await outbox.add_async(session, Event("order", str(order_id), "OrderPlaced", placed))
    return int(order_id)


@app.post("/orders")
async def place(order: NewOrder) -> dict[str, int]:
    async with sessions() as session, session.begin():
        return {"id": await _place(session, order)}


@app.post("/orders/{order_id}/pay")
async def pay(order_id: int) -> dict[str, int]:
    async with sessions() as session, session.begin():
        row = (
            await session.execute(
                text("UPDATE orders SET status = 'paid', version = version + 1 WHERE id = :id RETURNING version"),
                {"id": order_id},
            )
        ).one_or_none()
        if row is None:
            raise HTTPException(404, f"no order {order_id}")
        await outbox.add_async(
            session, Event("order", str(order_id), "OrderPaid", {"order_id": order_id, "version": row[0]})
        )
        return {"id": order_id, "version": row[0]}
