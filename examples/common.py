"""What both examples share: where the database and RabbitMQ are, and the example database
created when absent (each example runs in a database of its own, never in yours)."""

from __future__ import annotations

import os

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

SERVER_DSN = os.environ.get("EXAMPLE_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("EXAMPLE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
EXCHANGE = os.environ.get("EXAMPLE_EXCHANGE", "outbox-example")


def database(name: str) -> str:
    """The DSN of database ``name`` on SERVER_DSN's server, created if absent."""
    with psycopg.connect(SERVER_DSN, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(SERVER_DSN, dbname=name)


def sqlalchemy_url(dsn: str, *, driver: str = "psycopg") -> str:
    d = conninfo_to_dict(dsn)
    auth = d["user"] + (f":{d['password']}" if d.get("password") else "")
    return f"postgresql+{driver}://{auth}@{d.get('host', '127.0.0.1')}:{d.get('port', 5432)}/{d['dbname']}"
