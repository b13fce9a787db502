"""Where the ``sql/`` directory is, how its named statements are read, and each one
rendered for an outbox: the one module that reads ``sql/``.

Installed wheels carry ``sql/`` as ``relay/_sql``; a source checkout (and an editable
install) reads the top-level ``sql/`` beside the packages.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from psycopg import sql

from relay.db.names import OutboxNames

_HEADER = re.compile(r"^-- (?P<name>[a-z_][a-z0-9_]*) --$", re.MULTILINE)
# DDL to read and to compare with the migrations (tests/test_schema_file.py), not named
# statements: the one file under sql/ that named_queries() skips.
_SCHEMA = "schema.sql"
# The grants take a {role} and a {database} besides the outbox's names, so the store's and
# the operator tools' renderers (which fill every statement with names alone) never see
# them: relay.db.grants reads them through named_grants().
_GRANTS = "grants.sql"
# The statements on one partition take a {partition} as well (relay.db.partitions renders
# them): read through named_partition_ddl(), like the grants.
_PARTITION_DDL = "partition_ddl.sql"


def sql_dir() -> Path:
    package = Path(__file__).resolve().parent.parent  # relay/
    for candidate in (package / "_sql", package.parent / "sql"):
        if (candidate / "queries.sql").is_file():
            return candidate
    raise FileNotFoundError("the relay's sql/ directory is missing from this installation")


@cache
def named_queries() -> dict[str, str]:
    """Every named statement of ``sql/*.sql`` (the dispatch path's ``queries.sql``, the
    operator tools' ``ops.sql``; not ``schema.sql`` nor ``grants.sql``) as ``{name: statement}``, parsed once
    per process."""
    queries: dict[str, str] = {}
    for path in sorted(sql_dir().glob("*.sql")):
        if path.name in (_SCHEMA, _GRANTS, _PARTITION_DDL):
            continue
        for name, statement in _parse(path.read_text(encoding="utf-8")).items():
            if name in queries:
                raise ValueError(f"query {name!r} is defined twice under sql/")
            queries[name] = statement
    return queries


def _parse(text: str) -> dict[str, str]:
    matches = list(_HEADER.finditer(text))
    queries: dict[str, str] = {}
    for match, following in zip(matches, [*matches[1:], None], strict=True):
        end = following.start() if following else len(text)
        body = text[match.end() : end].strip()
        # Drop the description lines under the header; keep the statement itself.
        lines = body.splitlines()
        while lines and lines[0].startswith("--"):
            lines.pop(0)
        queries[match.group("name")] = "\n".join(lines).strip().rstrip(";")
    return queries


@cache
def statement(names: OutboxNames, name: str) -> sql.Composed:
    """The named statement ``name`` of ``sql/*.sql`` rendered for the outbox ``names``,
    once per process."""
    return names.render(named_queries()[name])


@cache
def named_grants() -> dict[str, str]:
    """The named statements of ``sql/grants.sql`` (relay.db.grants), parsed once per process."""
    return _parse((sql_dir() / _GRANTS).read_text(encoding="utf-8"))


@cache
def named_partition_ddl() -> dict[str, str]:
    """The named statements of ``sql/partition_ddl.sql`` (relay.db.partitions), parsed once per process."""
    return _parse((sql_dir() / _PARTITION_DDL).read_text(encoding="utf-8"))


def migrations() -> list[tuple[int, str, str]]:
    """``(version, name, text)`` for every ``sql/migrations/NNNN_name.sql``, in order."""
    found = []
    for path in sorted((sql_dir() / "migrations").glob("*.sql")):
        number, _, name = path.stem.partition("_")
        if not number.isdigit():
            raise ValueError(f"migration file name must start with a number: {path.name}")
        found.append((int(number), name, path.read_text(encoding="utf-8")))
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise ValueError("two migration files share a number")
    return found


def schema_sql() -> str:
    """``sql/schema.sql``: what an empty schema holds after every migration, with the
    migrations' placeholders (render it with :meth:`relay.db.names.OutboxNames.render`)."""
    return (sql_dir() / _SCHEMA).read_text(encoding="utf-8")
