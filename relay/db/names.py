"""The outbox's schema and table names, validated, and SQL text rendered with them.

Names come from configuration, so they are checked against a strict pattern and then
only ever reach SQL as quoted identifiers through :mod:`psycopg.sql`; nothing from input
is pasted into a statement.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

from psycopg import sql

from relay.errors import ConfigError, shown

# PostgreSQL truncates identifiers at 63 bytes (NAMEDATALEN - 1); related objects are
# named "<table>_<suffix>" with suffixes of up to 20 characters, so tables stop at 40.
NAME_MAX = 40
IDENTIFIER_MAX = 63
_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass(frozen=True)
class OutboxNames:
    """The schema and table of one outbox, and the names derived from them."""

    schema: str = "public"
    table: str = "outbox"

    def __post_init__(self) -> None:
        for kind, value in (("schema", self.schema), ("table", self.table)):
            if not isinstance(value, str):
                raise ConfigError(f"invalid {kind} name: expected a string, not {type(value).__name__}")
            # Length first: the value is quoted in the error, cut, however long it is.
            if len(value) > NAME_MAX:
                raise ConfigError(
                    f"invalid {kind} name {shown(value)}: longer than {NAME_MAX} characters"
                    f" (PostgreSQL identifiers end at {IDENTIFIER_MAX} bytes, and the relay adds suffixes)"
                )
            if not _NAME.fullmatch(value):
                raise ConfigError(
                    f"invalid {kind} name {shown(value)}: use 1-{NAME_MAX} lowercase letters, digits or"
                    " underscores, not starting with a digit"
                )
        # The insert trigger notifies channel "schema.table", and pg_notify refuses a channel
        # name of 64 bytes or more: every producer's INSERT would fail.
        channel = len(self.schema) + 1 + len(self.table)
        if channel > IDENTIFIER_MAX:
            raise ConfigError(
                f"schema and table names too long together: the wake-up channel {self.schema}.{self.table}"
                f" is {channel} characters, PostgreSQL allows {IDENTIFIER_MAX}"
            )

    @property
    def qualified(self) -> str:
        """``schema.table`` for messages (already validated, so safe to print)."""
        return f"{self.schema}.{self.table}"

    def identifier(self, key: str) -> sql.Composable:
        """What a ``{key}`` placeholder in a SQL file stands for."""
        if key == "outbox":
            return sql.Identifier(self.schema, self.table)
        if key == "schema":
            return sql.Identifier(self.schema)
        prefix, _, suffix = key.partition("_")
        if prefix == "q" and suffix:
            return sql.Identifier(self.schema, f"{self.table}_{suffix}")
        if prefix == "n" and suffix:
            return sql.Identifier(f"{self.table}_{suffix}")
        raise KeyError(f"unknown SQL placeholder {{{key}}}")

    def render(self, text: str) -> sql.Composed:
        """Fill every ``{placeholder}`` of ``text`` with its quoted identifier."""
        keys = {field for _, field, _, _ in string.Formatter().parse(text) if field}
        return sql.SQL(text).format(**{key: self.identifier(key) for key in keys})
