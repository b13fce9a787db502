"""Building workers over the in-memory publisher for tests, and the messages adapter tests send."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from relay.backoff import Backoff
from relay.config import CORE_OPTIONS, START_OPTIONS, RelaySettings
from relay.contract import PublishLimits
from relay.db.commit_order import CommitOrder
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.settings import SettingsUpdate, update_settings
from relay.db.statements import migrations, named_queries
from relay.decide import Policy
from relay.message import OutboxMessage
from relay.options import resolve
from relay.testing import InMemoryPublisher, Script
from relay.worker import Worker, WorkerConfig

# What `relay start` tells an adapter with its default settings (--publish-timeout 20s,
# --workers 4, --batch-size 100).
DEFAULT_LIMITS = PublishLimits(publish_timeout=timedelta(seconds=20), workers=4, batch_size=100)


def make_worker(
    store: OutboxStore,
    script: Script | None = None,
    *,
    owner: str = "w",
    batch_size: int = 10,
    max_attempts: int = 3,
    publish_timeout: timedelta = timedelta(seconds=5),
    lease: timedelta = timedelta(seconds=30),
    backoff: Backoff | None = None,
    defer_max_age: timedelta = timedelta(days=1),
    publisher: InMemoryPublisher | None = None,
    poll_interval: timedelta = timedelta(milliseconds=20),
) -> tuple[Worker, InMemoryPublisher]:
    publisher = publisher or InMemoryPublisher(script=script)
    config = WorkerConfig(
        batch_size=batch_size,
        lease=lease,
        publish_timeout=publish_timeout,
        poll_interval=poll_interval,
        policy=Policy(max_attempts=max_attempts, backoff=backoff or Backoff(), defer_max_age=defer_max_age),
    )
    return Worker(store=store, publisher=publisher, owner=owner, config=config), publisher


def terminate_relay_sessions(dsn: str) -> None:
    """Kill every relay session in PostgreSQL (they carry application_name outbox-relay)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'outbox-relay' AND pid <> pg_backend_pid()"
        )


def create_outbox_at(conn: psycopg.Connection[Any], names: OutboxNames, version: int) -> None:
    """Create ``names``' schema and apply the shipped migrations up to ``version`` only, with
    their ledger: an outbox as an earlier release left it, for upgrade tests."""
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
    ledger = sql.Identifier(names.schema, f"{names.table}_migrations")
    conn.execute(
        sql.SQL(
            "CREATE TABLE {} (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(ledger)
    )
    for number, name, text in migrations():
        if number <= version:
            conn.execute(names.render(text))
            conn.execute(sql.SQL("INSERT INTO {} VALUES (%s, %s)").format(ledger), (number, name))


def record_listeners(conn: psycopg.Connection[Any], names: OutboxNames, rows: list[tuple[str, bool, str]]) -> None:
    """Make <table>_listeners hold exactly ``rows``, as relay processes write them:
    ``(owner, idle, valid for)``, a negative interval for a killed relay's lapsed row. The
    producers' answer in the settings row is recomputed from them by the relays' own
    statements (sql/queries.sql)."""
    queries = named_queries()
    table = sql.Identifier(names.schema, f"{names.table}_listeners")
    with conn.transaction():
        conn.execute(names.render(queries["listener_turn"]))
        conn.execute(sql.SQL("DELETE FROM {}").format(table))
        for owner, idle, valid in rows:
            conn.execute(
                sql.SQL("INSERT INTO {} (owner, idle, expires_at) VALUES (%s, %s, now() + %s::interval)").format(table),
                (owner, idle, valid),
            )
        conn.execute(names.render(queries["listener_answer"]))


def settings_for(pg_dsn: str, names: OutboxNames, **over: object) -> RelaySettings:
    """`relay start`'s settings for an in-process relay over ``names``: the defaults, the
    log broker, a 50 ms poll, and ``over`` on top (option dests as keys)."""
    values = resolve((*CORE_OPTIONS, *START_OPTIONS), {}, {}, {})
    values.update(
        dsn=pg_dsn, schema=names.schema, table=names.table, broker="log", poll_interval=timedelta(milliseconds=50)
    )
    values.update(over)
    return RelaySettings.from_values(values)


def outbox_message(
    id: int,
    aggregate: str = "order-1",
    event_type: str = "OrderCreated",
    *,
    payload: Any = None,
    body: bytes | None = None,
    ordered: bool = False,
    aggregate_seq: int | None = None,
    headers: dict[str, str] | None = None,
    event_id: str | None = None,
    aggregate_epoch: str | None = None,
) -> OutboxMessage:
    """An outbox message as a claim gives it to an adapter: the payload ``{"n": id}`` by default,
    attempt 2 and lease version 7 (so a test sees them carried, not defaulted)."""
    data = body if body is not None else json.dumps(payload if payload is not None else {"n": id}).encode()
    return OutboxMessage(
        id=id,
        aggregate_type="order",
        aggregate_id=aggregate,
        event_type=event_type,
        body=data,
        attempt=2,
        lease_version=7,
        ordered=ordered,
        aggregate_seq=aggregate_seq,
        headers=headers,
        event_id=event_id,
        aggregate_epoch=aggregate_epoch,
    )


def sqlalchemy_url(dsn: str, *, driver: str = "psycopg") -> str:
    """A libpq DSN of the test database as a SQLAlchemy URL (trust authentication: no password)."""
    from psycopg.conninfo import conninfo_to_dict

    d = conninfo_to_dict(dsn)
    return f"postgresql+{driver}://{d['user']}@{d.get('host', '127.0.0.1')}:{d.get('port', 5432)}/{d['dbname']}"


def http_get(url: str, timeout: float = 5) -> tuple[int, str]:
    """Status and body of a GET (an error status included); (0, reason) while nothing
    listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


async def set_commit_order(owner_dsn: str, names: OutboxNames, mode: CommitOrder) -> None:
    """`relay settings set --commit-order MODE` for ``names``, as the table's owner."""
    async with await psycopg.AsyncConnection.connect(owner_dsn, autocommit=True) as conn:
        await update_settings(conn, names, SettingsUpdate(commit_order=mode))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a relay's metrics endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
