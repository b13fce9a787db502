"""An Alembic ``env.py`` for a service whose database also holds the relay's tables: the
outbox and its ``outbox_*`` side tables are made and upgraded by ``relay migrate``, the
inbox's by ``relay.Inbox.migrate``, so autogenerate must neither drop nor alter them.
``include_name`` is all it takes; tests/test_alembic.py checks that autogenerate then
proposes nothing for them."""

from __future__ import annotations

from alembic import context
from myservice.models import Base  # type: ignore[import-not-found]  # your models' metadata
from sqlalchemy import engine_from_config, pool

# The --table names given to `relay migrate` and relay.Inbox (their defaults here).
RELAY_TABLES = ("outbox", "inbox")


def include_name(name: str | None, type_: str, parent_names: object) -> bool:
    """Leave the relay's tables (and their indexes, sequences, functions) to the relay."""
    if type_ == "table" and name is not None:
        return not any(name == t or name.startswith(t + "_") for t in RELAY_TABLES)
    return True


def run_migrations_online() -> None:
    connectable = engine_from_config(context.config.get_section(context.config.config_ini_section) or {},
                                     prefix="sqlalchemy.", poolclass=pool.NullPool)  # fmt: skip
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=Base.metadata, include_name=include_name)
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
