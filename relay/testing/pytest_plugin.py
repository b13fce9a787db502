"""pytest fixtures for testing code that writes to an outbox, with the relay delivering it.

Load it in your top ``conftest.py`` (it is not loaded by merely installing outbox-relay,
so that it never adds fixtures to a suite that did not ask for them)::

    pytest_plugins = ["relay.testing.pytest_plugin"]

and point it at a PostgreSQL the tests may create schemas in, with ``--relay-dsn DSN`` or
``RELAY_TEST_DSN`` (without either, the tests that use these fixtures skip, saying so).

* ``migrated_outbox``: an outbox of the test's own, migrated as ``relay migrate`` does, in
  a new schema dropped after the test (:class:`MigratedOutbox`);
* ``running_relay``: a relay (:class:`relay.Relay`) delivering that outbox while the test
  runs (:class:`RunningRelay`), into an :class:`~relay.testing.InMemoryPublisher` unless
  ``relay_settings`` names a broker;
* ``relay_settings``: ``relay start``'s settings for that relay (``{}``); override it to
  deliver to a real destination, or to change a setting::

      @pytest.fixture
      def relay_settings(rabbitmq_url):
          return {"broker": "rabbitmq", "amqp_url": rabbitmq_url, "exchange": "events"}

Both fixtures are coroutines run by pytest-asyncio; a test using them is ``async def``
(marked ``@pytest.mark.asyncio`` unless your suite runs in auto mode).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import pytest_asyncio
from psycopg import sql

from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.embed import Relay
from relay.message import OutboxMessage
from relay.testing.memory import InMemoryPublisher
from relay.writer import Outbox

__all__ = ["MigratedOutbox", "RunningRelay"]

# Where the fixtures make their outboxes when --relay-dsn is not given.
DSN_VARIABLE = "RELAY_TEST_DSN"
# How long RunningRelay.delivered waits: a relay woken by the outbox's notification
# delivers within milliseconds; ten seconds is a stalled relay, not a slow machine.
DELIVERY_TIMEOUT_S = 10.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--relay-dsn",
        default=None,
        help=f"PostgreSQL the relay.testing fixtures make outboxes in (default: ${DSN_VARIABLE})",
    )


@dataclass(frozen=True)
class MigratedOutbox:
    """An outbox of one test's own: write events to it with :attr:`outbox`, on a
    connection to :attr:`dsn`, inside a transaction, as the application does."""

    dsn: str
    schema: str
    table: str = "outbox"

    @property
    def outbox(self) -> Outbox:
        """The writer for this outbox (``outbox.add(conn, Event(...))``)."""
        return Outbox(self.table, self.schema)

    @property
    def settings(self) -> dict[str, str]:
        """``dsn``, ``schema`` and ``table``, as :class:`relay.Relay` takes them."""
        return {"dsn": self.dsn, "schema": self.schema, "table": self.table}


@dataclass
class RunningRelay:
    """A relay delivering a :class:`MigratedOutbox` beside the test.

    :param relay: the running relay.
    :param publisher: where it delivers when ``relay_settings`` named no broker; None
        when it delivers to the broker named.
    """

    relay: Relay
    publisher: InMemoryPublisher | None = field(default=None)

    async def delivered(self, count: int) -> list[OutboxMessage]:
        """Every message the relay delivered, once at least ``count`` have been (the
        in-memory publisher only). ``TimeoutError`` saying how many came if they do not
        within :data:`DELIVERY_TIMEOUT_S` (wrap the call in a longer ``asyncio.timeout``
        and call ``publisher.wait_delivered`` for another bound)."""
        if self.publisher is None:
            raise RuntimeError("the relay delivers to the broker relay_settings named: read it from there")
        try:
            async with asyncio.timeout(DELIVERY_TIMEOUT_S):
                return await self.publisher.wait_delivered(count)
        except TimeoutError:
            got = len(self.publisher.delivered)
            raise TimeoutError(f"{got} of {count} messages delivered within {DELIVERY_TIMEOUT_S:g}s") from None


@pytest.fixture(scope="session")
def relay_test_dsn(request: pytest.FixtureRequest) -> str:
    """The PostgreSQL the fixtures make outboxes in: ``--relay-dsn``, else ``RELAY_TEST_DSN``."""
    dsn = request.config.getoption("--relay-dsn") or os.environ.get(DSN_VARIABLE)
    if not dsn:
        pytest.skip(f"no PostgreSQL for relay.testing's fixtures: pass --relay-dsn or set {DSN_VARIABLE}")
    return str(dsn)


@pytest_asyncio.fixture
async def migrated_outbox(relay_test_dsn: str) -> AsyncIterator[MigratedOutbox]:
    """An outbox in a schema of its own, migrated as ``relay migrate`` does, dropped (with
    everything in its schema) after the test."""
    names = OutboxNames(schema=f"relay_test_{uuid.uuid4().hex[:12]}")
    async with await psycopg.AsyncConnection.connect(relay_test_dsn, autocommit=True) as conn:
        await migrate(conn, names)
    try:
        yield MigratedOutbox(relay_test_dsn, names.schema, names.table)
    finally:
        async with await psycopg.AsyncConnection.connect(relay_test_dsn, autocommit=True) as conn:
            await conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(names.schema)))


@pytest.fixture
def relay_settings() -> Mapping[str, Any]:
    """``relay start``'s settings for ``running_relay`` beyond the outbox's own (named as
    :class:`relay.Relay` takes them): none, so it delivers into an in-memory publisher.
    Override this fixture to name a broker and its settings, or to change a setting."""
    return {}


@pytest_asyncio.fixture
async def running_relay(
    migrated_outbox: MigratedOutbox, relay_settings: Mapping[str, Any]
) -> AsyncIterator[RunningRelay]:
    """A relay delivering ``migrated_outbox`` from before the test starts until after it
    ends (stopped as SIGTERM stops ``relay start``); its error, if it failed, is raised."""
    settings = {**migrated_outbox.settings, **relay_settings}
    publisher = None
    if "broker" not in relay_settings:
        publisher = InMemoryPublisher()
        relay = Relay(publisher=publisher, **settings)
    else:
        relay = Relay(**settings)
    async with relay:
        yield RunningRelay(relay, publisher)
