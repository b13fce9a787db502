"""Describing a PostgreSQL or broker address without ever showing its password."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from psycopg.conninfo import conninfo_to_dict

from relay.errors import ConfigError

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]*)@", re.I)
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.I)


def mask(text: str) -> str:
    """Replace any password in URLs or ``key=value`` strings inside ``text`` with ``***``."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    return _KV_PASSWORD.sub(lambda m: f"{m.group(1)}***", text)


def describe_dsn(dsn: str) -> str:
    """``host:port/dbname`` for error messages, or a ConfigError if the DSN is malformed.

    The parser's own message can quote the DSN, so it is not passed on.
    """
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        raise ConfigError("invalid --dsn: not a PostgreSQL connection string or URL") from None
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "(default)")
    return f"host {host}:{port} database {dbname!r}"


def describe_url(url: str) -> str:
    """``scheme://host:port/path`` with user name kept and password dropped."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return mask(url)
    user = f"{parts.username}@" if parts.username else ""
    return f"{parts.scheme}://{user}{host}{port}{parts.path}"
