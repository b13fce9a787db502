"""examples/consumer.py, run as written (issue 38, item 8): the documented consumer, a
prefetch of 50 and a connection per message from a pool, against real relays publishing
to RabbitMQ, with relays and the consumer itself SIGKILLed throughout, producers that lock
the order and producers that do not. Judged by the consumer's own ``order_log`` against
what the service committed: every event applied once, each order's events in commit
order and in ``aggregate_seq`` order (tests/orders_pipeline.py).

The example as it was (one AsyncConnection shared by aio-pika's concurrent deliveries)
stalled, or acknowledged events it had not applied: 302 acknowledged, 2 applied.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from relay.db.names import OutboxNames
from tests.orders_pipeline import ROOT, Effect, read_rows, run_pipeline, start_process
from tests.orders_pipeline import orders_service as orders_service  # the fixture, for pytest to find
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import RelayProcess


@pytest.fixture
async def example_topology(rabbit: Rabbit) -> tuple[str, str]:
    """The exchange and queue the example declares, as it declares them (`rabbit` deletes
    them afterwards)."""
    exchange = await rabbit.exchange("topic")
    queue = await rabbit.queue(bind=(exchange, "#"))
    return exchange, queue


async def run_example(
    *, kinds: tuple[str, ...], seconds: float, seed: int, orders_service: str, pg_dsn: str, relay_dsn: str,
    scratch_dsn: str, names: OutboxNames, rabbit: Rabbit, example_topology: tuple[str, str],
    relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    exchange, queue = example_topology
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EXAMPLE_DSN": pg_dsn,
        "EXAMPLE_CONSUMER_DATABASE": conninfo_to_dict(scratch_dsn)["dbname"],
        "EXAMPLE_AMQP_URL": rabbit.amqp.url,
        "EXAMPLE_EXCHANGE": exchange,
        "EXAMPLE_QUEUE": queue,
    }
    log = tmp_path / "consumer.log"

    def start_consumer() -> subprocess.Popen[bytes]:
        return start_process([sys.executable, "-m", "examples.consumer"], env, log)

    def effects() -> list[Effect]:
        try:
            return read_rows(
                scratch_dsn,
                sql.SQL(
                    "SELECT payload->>'ref', order_id, event_type, CAST(payload->>'version' AS integer), aggregate_seq"
                    " FROM order_log ORDER BY applied"
                ),
            )
        except Exception:  # not created yet: the example makes it at start
            return []

    await run_pipeline(
        url=orders_service, pg_dsn=pg_dsn, relay_dsn=relay_dsn, names=names, amqp_url=rabbit.amqp.url,
        exchange=exchange, relays=relays, start_consumer=start_consumer, effects=effects, consumer_log=log,
        kinds=kinds, seconds=seconds, seed=seed,
    )  # fmt: skip


async def test_the_example_consumer_applies_every_committed_event_once_in_order(
    orders_service: str, pg_dsn: str, relay_dsn: str, scratch_dsn: str, names: OutboxNames, rabbit: Rabbit,
    example_topology: tuple[str, str], relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """Locked and unlocked producers at once, for 10 s of load."""
    await run_example(
        kinds=("locked", "unlocked"), seconds=10, seed=38, orders_service=orders_service, pg_dsn=pg_dsn,
        relay_dsn=relay_dsn, scratch_dsn=scratch_dsn, names=names, rabbit=rabbit,
        example_topology=example_topology, relays=relays, tmp_path=tmp_path,
    )  # fmt: skip


@pytest.mark.extended
@pytest.mark.parametrize("kind", ["locked", "unlocked"])
async def test_the_example_consumer_applies_every_committed_event_once_in_order_longer(
    kind: str, orders_service: str, pg_dsn: str, relay_dsn: str, scratch_dsn: str, names: OutboxNames,
    rabbit: Rabbit, example_topology: tuple[str, str], relays: list[RelayProcess], tmp_path: Path,
) -> None:  # fmt: skip
    """One kind of producer at a time, for 60 s of load."""
    await run_example(
        kinds=(kind,), seconds=60, seed=3801, orders_service=orders_service, pg_dsn=pg_dsn, relay_dsn=relay_dsn,
        scratch_dsn=scratch_dsn, names=names, rabbit=rabbit, example_topology=example_topology, relays=relays,
        tmp_path=tmp_path,
    )  # fmt: skip
