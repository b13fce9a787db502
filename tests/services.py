"""Where the tests find their real services, and which fixtures stand for one.

PostgreSQL: ``RELAY_TEST_DSN``; else a testcontainers PostgreSQL where a Docker engine
answers; else the tests that need it skip with a line that says how to provide one.

A test that needs a service is an integration test, every other a unit test, and nobody
marks either by hand: tests/conftest.py marks ``integration`` each test whose fixture
closure holds one of :data:`SERVICE_FIXTURES`, and fails a test it did not mark that
reaches one anyway (through ``request.getfixturevalue``). `make test-unit` runs the rest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

SKIP_PG = (
    "no PostgreSQL for the tests: set RELAY_TEST_DSN=postgresql://user@host:port/db "
    "(bash .ci/run does this) or run a Docker engine for testcontainers"
)


# The fixtures that start or reach a service; everything that needs a service goes through
# one of them (a relay process that needs a database gets its DSN from ``pg_dsn``, an
# HTTP receiver writes to PostgreSQL through ``pg_dsn``). Importing the modules that define
# them starts nothing: each starts its service, or looks for it, when first requested.
SERVICE_FIXTURES: frozenset[str] = frozenset(
    {
        "pg_dsn",  # PostgreSQL (tests/conftest.py)
        "pg_pair",  # a primary and its standby, clusters of their own (tests/pg_clusters.py)
        "silent_pair",  # the same, the primary in a network namespace (tests/pg_clusters.py)
        "amqp",  # RabbitMQ (tests/rabbitmq_broker.py)
        "moto_endpoint",  # moto's SQS and SNS in server mode (tests/sqs_server.py)
        "kafka",  # the Kafka-protocol broker, shared (tests/kafka_broker.py)
        "own_kafka",  # the same, one of the test's own (tests/kafka_broker.py)
        "nats_url",  # NATS with JetStream (tests/nats_server.py)
        "redis_stream",  # Redis, for the installed destination (tests/test_installed_destinations.py)
        "redis_client",  # the same, its conformance suite (tests/plugins/redis_streams/tests/)
    }
)


def require_services() -> bool:
    """In CI (``RELAY_TEST_REQUIRE_SERVICES=1``) a missing service fails the run instead of skipping."""
    return os.environ.get("RELAY_TEST_REQUIRE_SERVICES") == "1"


def docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@contextmanager
def postgres_dsn() -> Iterator[str | None]:
    dsn = os.environ.get("RELAY_TEST_DSN")
    if dsn:
        yield dsn
        return
    if docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:16-alpine", driver=None) as pg:
            yield pg.get_connection_url()
        return
    yield None
