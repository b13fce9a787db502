"""An orders service for tests/test_pipeline_inbox.py, run under uvicorn in its own process:
FastAPI, SQLAlchemy 2 async, and the events written with ``relay.Outbox`` in the request's
transaction.

Every event is also written to the service's own ``order_history`` table in the same
transaction (``ref``, the order, the version): the test's record of what was committed,
kept by the application and not by the relay.

Two kinds of producers:

* **locked**: ``POST /orders`` places an order, ``POST /orders/{id}/items`` locks the
  order's row (``FOR UPDATE``), bumps its version and writes the event; the versions are
  the order's commit order.
* **unlocked**: ``POST /orders/{id}/notes/hold`` opens a transaction that writes a note's
  event without locking anything and answers before committing; ``POST
  /held/{token}/more`` writes more into it; ``POST /held/{token}/commit`` or
  ``.../rollback`` ends it. The test issues those commits one at a time, so their order
  (against the ids, often) is known outside the service.

Settings from the environment: ORDERS_DSN, ORDERS_SCHEMA.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from examples.common import sqlalchemy_url
from relay import Event, Outbox

SCHEMA = os.environ["ORDERS_SCHEMA"]
engine = create_async_engine(
    sqlalchemy_url(os.environ["ORDERS_DSN"]),
    pool_size=30,
    max_overflow=10,
    connect_args={"options": f"-c search_path={SCHEMA}"},
)
sessions = async_sessionmaker(engine, expire_on_commit=False)
outbox = Outbox(schema=SCHEMA)
# Transactions the unlocked producers hold open between requests, by token.
held: dict[str, tuple[AsyncSession, int, list[str]]] = {}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    for session, _order, _refs in held.values():
        await session.close()
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


async def _event(session: AsyncSession, order_id: int, event_type: str, version: int | None) -> str:
    ref = str(uuid.uuid4())
    await session.execute(
        text("INSERT INTO order_history (ref, order_id, event_type, version) VALUES (:r, :o, :t, :v)"),
        {"r": ref, "o": order_id, "t": event_type, "v": version},
    )
    payload: dict[str, Any] = {"ref": ref, "order_id": order_id, "version": version}
    await outbox.add_async(session, Event("order", str(order_id), event_type, payload))
    return ref


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/orders")
async def place() -> dict[str, Any]:
    async with sessions() as session, session.begin():
        [order_id] = (await session.execute(text("INSERT INTO orders DEFAULT VALUES RETURNING id"))).one()
        ref = await _event(session, order_id, "OrderPlaced", 1)
        # And an event of a type that is not ordered, in the same transaction.
        await _event(session, order_id, "EmailQueued", None)
    return {"id": order_id, "ref": ref}


@app.post("/orders/{order_id}/items")
async def add_item(order_id: int) -> dict[str, Any]:
    async with sessions() as session, session.begin():
        row = (
            await session.execute(
                text("UPDATE orders SET version = version + 1 WHERE id = :id RETURNING version"), {"id": order_id}
            )
        ).one_or_none()
        if row is None:
            raise HTTPException(404, f"no order {order_id}")
        ref = await _event(session, order_id, "OrderItemAdded", row[0])
    return {"id": order_id, "ref": ref, "version": row[0]}


@app.post("/orders/{order_id}/notes/hold")
async def hold_note(order_id: int) -> dict[str, Any]:
    session = sessions()
    await session.begin()
    try:
        ref = await _event(session, order_id, "OrderNoted", None)
    except BaseException:
        await session.close()
        raise
    token = uuid.uuid4().hex
    held[token] = (session, order_id, [ref])
    return {"token": token}


@app.post("/held/{token}/more")
async def hold_more(token: str) -> dict[str, Any]:
    session, order_id, refs = held[token]
    refs.append(await _event(session, order_id, "OrderNoted", None))
    return {"token": token}


@app.post("/held/{token}/commit")
async def commit_held(token: str) -> dict[str, Any]:
    session, _order_id, refs = held.pop(token)
    try:
        await session.commit()
    finally:
        await session.close()
    return {"refs": refs}


@app.post("/held/{token}/rollback")
async def rollback_held(token: str) -> dict[str, Any]:
    session, _order_id, _refs = held.pop(token)
    await session.rollback()
    await session.close()
    return {"refs": []}
