"""Where the tests find their real services.

PostgreSQL: ``RELAY_TEST_DSN``; else a testcontainers PostgreSQL where a Docker engine
answers; else the tests that need it skip with a line that says how to provide one.
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
