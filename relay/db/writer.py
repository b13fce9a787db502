"""What producers run (sql/writer.sql), rendered for one outbox as plain text: relay.Outbox
runs it through whatever connection or session the application holds
(relay._transactions), which takes text, not psycopg's composed SQL."""

from __future__ import annotations

from dataclasses import dataclass

from relay.db.names import OutboxNames
from relay.db.statements import statement


@dataclass(frozen=True)
class WriterStatements:
    """``insert`` (many events in one statement, in order) and ``insert_one``."""

    insert: str
    insert_one: str

    @classmethod
    def of(cls, names: OutboxNames) -> WriterStatements:
        return cls(
            statement(names, "outbox_insert").as_string(None), statement(names, "outbox_insert_one").as_string(None)
        )
