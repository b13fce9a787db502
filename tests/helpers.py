"""Building workers over the in-memory publisher for tests."""

from __future__ import annotations

from datetime import timedelta

from adapters.memory import InMemoryPublisher, Script
from relay.backoff import Backoff
from relay.decide import Policy
from relay.store import OutboxStore
from relay.worker import Worker, WorkerConfig


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
