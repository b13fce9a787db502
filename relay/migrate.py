"""Applies the numbered migrations under ``sql/migrations`` to one outbox.

Safe to run from several processes at once: every run takes a transaction-scoped
advisory lock keyed by the outbox's name before it looks at what is applied, and
applies all missing migrations plus their bookkeeping rows in that one transaction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg
from psycopg import sql

from relay.sqlfiles import migrations
from relay.sqlnames import OutboxNames

log = logging.getLogger("relay.migrate")


@dataclass(frozen=True)
class MigrationResult:
    applied: list[str]
    already: list[str]


async def migrate(conn: psycopg.AsyncConnection[object], names: OutboxNames) -> MigrationResult:
    """Bring the outbox ``names`` up to the newest migration; idempotent."""
    ledger = names.identifier("q_migrations")
    async with conn.transaction():
        # The lock comes first: even CREATE ... IF NOT EXISTS races when two run at once.
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"outbox-relay:{names.qualified}",)
        )
        await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(names.identifier("schema")))
        await conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} ("
                " version integer PRIMARY KEY,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ledger)
        )
        cur = await conn.execute(sql.SQL("SELECT version FROM {}").format(ledger))
        done = {row[0] for row in await cur.fetchall()}  # type: ignore[index]
        applied, already = [], []
        for version, name, text in migrations():
            label = f"{version:04d}_{name}"
            if version in done:
                already.append(label)
                continue
            await conn.execute(names.render(text))
            await conn.execute(
                sql.SQL("INSERT INTO {} (version, name) VALUES (%s, %s)").format(ledger), (version, name)
            )
            applied.append(label)
            log.info("applied migration %s to %s", label, names.qualified)
    return MigrationResult(applied=applied, already=already)
