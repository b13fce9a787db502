"""Both ends of the pipe under fire: a FastAPI service (tests/orders_app.py, under uvicorn)
writes orders and their events through ``relay.Outbox`` (SQLAlchemy async) under
concurrent HTTP load (httpx); relays deliver them to RabbitMQ and are SIGKILLed every 1-2 s;
a consumer process (tests/orders_consumer.py) applies each event's effect to its own
database through ``relay.Inbox`` and is itself killed every 3-6 s. The harness is
tests/orders_pipeline.py, which tests/test_consumer_example.py runs examples/consumer.py
through.

The oracles come from outside the relay and the inbox:

* what was committed: the service's ``order_history``, written by the application in
  each request's transaction (a rolled-back transaction leaves nothing there);
* commit order per order: for producers that lock the order (``FOR UPDATE``) the
  version each transaction read under the lock; for producers that do not, the order in
  which this test issued their COMMITs, one at a time (against the id order, mostly);
* what was applied: the consumer's ``effects`` rows, which have no unique key, so an
  effect applied twice shows, with the ``aggregate_seq`` each event came with.

Every committed event is applied exactly once, and each order's ordered events in commit
order and in ``aggregate_seq`` order.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay import Inbox
from relay.db.names import OutboxNames
from tests.orders_pipeline import ROOT, Effect, read_rows, run_pipeline, start_process
from tests.orders_pipeline import orders_service as orders_service  # the fixture, for pytest to find
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess

CONSUMER_DATABASE = "relay_test_consumer"


@pytest.fixture
def consumer_db(pg_dsn: str) -> Iterator[tuple[str, str]]:
    """The consumer's own database (created once) and a schema of this test's in it."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (CONSUMER_DATABASE,)).fetchone() is None:
            # The other xdist process may make it meanwhile.
            with contextlib.suppress(psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(CONSUMER_DATABASE)))
    dsn = make_conninfo(pg_dsn, dbname=CONSUMER_DATABASE)
    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.effects (applied bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, ref uuid NOT NULL,"
                " aggregate_id text NOT NULL, event_type text NOT NULL, version integer, aggregate_seq bigint,"
                " event_id uuid NOT NULL)"
            ).format(sql.Identifier(schema))
        )
    with psycopg.connect(dsn) as conn:
        Inbox("inbox", schema).migrate(conn)
    yield dsn, schema
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


async def run_inbox_consumer(
    *, kinds: tuple[str, ...], seconds: float, seed: int, orders_service: str, pg_dsn: str, relay_dsn: str,
    names: OutboxNames, consumer_db: tuple[str, str], rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "orders"))  # the harness's relays publish with key "orders"
    consumer_dsn, consumer_schema = consumer_db
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CONSUMER_DSN": consumer_dsn,
        "CONSUMER_SCHEMA": consumer_schema,
        "CONSUMER_AMQP_URL": rabbit.amqp.url,
        "CONSUMER_QUEUE": queue,
    }
    log = tmp_path / "consumer.log"

    def start_consumer() -> subprocess.Popen[bytes]:
        return start_process([sys.executable, "-m", "tests.orders_consumer"], env, log)

    def effects() -> list[Effect]:
        return read_rows(
            consumer_dsn,
            sql.SQL(
                "SELECT ref::text, aggregate_id, event_type, version, aggregate_seq FROM {}.effects ORDER BY applied"
            ).format(sql.Identifier(consumer_schema)),
        )

    await run_pipeline(
        url=orders_service, pg_dsn=pg_dsn, relay_dsn=relay_dsn, names=names, amqp_url=rabbit.amqp.url,
        exchange=exchange, relays=relays, start_consumer=start_consumer, effects=effects, consumer_log=log,
        kinds=kinds, seconds=seconds, seed=seed,
    )  # fmt: skip


# In make test-all with its longer twin: tests/test_consumer_example.py runs the documented
# consumer the same way in make test.
@pytest.mark.extended
async def test_every_committed_event_is_applied_once_in_commit_order(
    orders_service: str, pg_dsn: str, relay_dsn: str, names: OutboxNames, consumer_db: tuple[str, str],
    rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """Locked and unlocked producers at once, for 8 s of load."""
    await run_inbox_consumer(
        kinds=("locked", "unlocked"), seconds=8, seed=26, orders_service=orders_service, pg_dsn=pg_dsn,
        relay_dsn=relay_dsn, names=names, consumer_db=consumer_db, rabbit=rabbit, relays=relays, tmp_path=tmp_path,
    )  # fmt: skip


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["locked", "unlocked"])
async def test_every_committed_event_is_applied_once_in_commit_order_longer(
    kind: str, orders_service: str, pg_dsn: str, relay_dsn: str, names: OutboxNames, consumer_db: tuple[str, str],
    rabbit: Rabbit, relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """One kind of producer at a time, for 40 s of load."""
    await run_inbox_consumer(
        kinds=(kind,), seconds=40, seed=2601, orders_service=orders_service, pg_dsn=pg_dsn, relay_dsn=relay_dsn,
        names=names, consumer_db=consumer_db, rabbit=rabbit, relays=relays, tmp_path=tmp_path,
    )  # fmt: skip
