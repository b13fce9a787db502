"""The inbox's statements (sql/inbox.sql), rendered for one inbox table as plain text:
relay.Inbox runs them through whatever connection or session the consumer holds
(relay._transactions), which takes text, not psycopg's composed SQL."""

from __future__ import annotations

from dataclasses import dataclass

from relay.db.names import OutboxNames
from relay.db.statements import statement


@dataclass(frozen=True)
class InboxStatements:
    """``create`` (tables and the receive function), ``receive`` (one delivery) and
    ``prune`` (old event ids) of one inbox table."""

    create: str
    receive: str
    prune: str

    @classmethod
    def of(cls, names: OutboxNames) -> InboxStatements:
        return cls(*(statement(names, f"inbox_{name}").as_string(None) for name in ("create", "receive", "prune")))
