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

from relay.errors import ConfigError
from relay.textsafe import clip

# PostgreSQL truncates identifiers at 63 bytes; related objects are named
# "<table>_<suffix>" with suffixes of up to 20 characters, so tables stop at 40.
_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class OutboxNames:
    """The schema and table of one outbox, and the names derived from them."""

    schema: str = "public"
    table: str = "outbox"

    def __post_init__(self) -> None:
        for kind, value in (("schema", self.schema), ("table", self.table)):
            if not isinstance(value, str) or not _NAME.match(value):
                shown = clip(value, 60) if isinstance(value, str) else value
                raise ConfigError(
                    f"invalid {kind} name {shown!r}: use 1-40 lowercase letters, digits or underscores,"
                    " not starting with a digit"
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
