"""Text in any database encoding: how the relay's sessions read it and write it.

PostgreSQL converts text between the database's encoding and each session's
``client_encoding``, so every relay session asks for UTF8: a LATIN1 or WIN1252 database
(any encoding the server can convert) reaches the relay as UTF-8, whatever the DSN or
``PGCLIENTENCODING`` asked for, and what the relay writes is converted back.

SQL_ASCII is the exception. Such a database stores whatever bytes producers send and
converts nothing. A UTF8 session there would have the server check every value it sends
us, and one row holding bytes that are not UTF-8 would fail the whole claim, on every
claim, holding up every row behind it. So the session stays SQL_ASCII (psycopg would then
hand text over as ``bytes``) and the relay decodes text itself, as UTF-8:

* ``exact`` sessions (the dispatch path) keep each byte that is not UTF-8 as a lone
  surrogate (Python's ``surrogateescape``): the store tells such a row apart with
  :func:`not_utf8` and sends it to dead alone, and its bytes are not lost;
* ``readable`` sessions (the operator commands) show such a byte as ``\\xe9``, so a
  listing never fails on the very row it is asked to show.
"""

from __future__ import annotations

from typing import Any, Literal

import psycopg
from psycopg import pq, sql
from psycopg._encodings import pg2pyenc  # psycopg's own map of PostgreSQL encoding names
from psycopg.abc import Buffer
from psycopg.adapt import Loader

SQL_ASCII = "SQL_ASCII"
UTF8 = "UTF8"

TextMode = Literal["exact", "readable"]

# The types psycopg loads as str (psycopg.types.string).
_TEXT_TYPES = ("text", "varchar", "bpchar", "name", '"char"')
_UNKNOWN_OID = 0  # a value whose type the server did not say; psycopg loads it as text too


class _ExactUtf8Loader(Loader):
    errors = "surrogateescape"

    def load(self, data: Buffer) -> str:
        return bytes(data).decode("utf-8", self.errors)


class _ExactUtf8BinaryLoader(_ExactUtf8Loader):
    format = pq.Format.BINARY


class _ReadableUtf8Loader(_ExactUtf8Loader):
    errors = "backslashreplace"


class _ReadableUtf8BinaryLoader(_ReadableUtf8Loader):
    format = pq.Format.BINARY


_LOADERS: dict[TextMode, tuple[type[Loader], type[Loader]]] = {
    "exact": (_ExactUtf8Loader, _ExactUtf8BinaryLoader),
    "readable": (_ReadableUtf8Loader, _ReadableUtf8BinaryLoader),
}


def server_encoding(conn: psycopg.AsyncConnection[Any]) -> str:
    """The database's encoding, as the server reported it when the session started."""
    return conn.info.parameter_status("server_encoding") or UTF8


async def set_up_text(conn: psycopg.AsyncConnection[Any], mode: TextMode) -> None:
    """Make ``conn`` exchange text with the relay as UTF-8 (see the module's docstring).
    ``conn`` must be in autocommit mode: the SET is a statement of its own."""
    sql_ascii = server_encoding(conn) == SQL_ASCII
    wanted = SQL_ASCII if sql_ascii else UTF8
    if conn.info.parameter_status("client_encoding") != wanted:  # already so in the common case
        await conn.execute(sql.SQL("SET client_encoding = {}").format(sql.Literal(wanted)))
    if sql_ascii:
        text_loader, binary_loader = _LOADERS[mode]
        for name in _TEXT_TYPES:
            conn.adapters.register_loader(name, text_loader)
            conn.adapters.register_loader(name, binary_loader)
        conn.adapters.register_loader(_UNKNOWN_OID, text_loader)


def not_utf8(value: str) -> str | None:
    """Where a value read by an ``exact`` session held a byte that is not UTF-8, as
    ``byte 0xe9 at offset 3``; None when the value is valid text."""
    if value.isascii():
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        offset = len(value[: exc.start].encode("utf-8", "surrogateescape"))
        # surrogateescape keeps byte 0xNN as the code point U+DCNN.
        return f"byte 0x{ord(value[exc.start]) - 0xDC00:02x} at offset {offset}"
    return None


def not_utf8_bytes(data: bytes) -> str | None:
    """:func:`not_utf8` for a payload read as the bytes PostgreSQL sent."""
    if data.isascii():
        return None
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte 0x{data[exc.start]:02x} at offset {exc.start}"
    return None


def original_bytes(value: str) -> bytes:
    """The bytes an ``exact`` session read, including any that were not UTF-8."""
    return value.encode("utf-8", "surrogateescape")


def readable(value: str) -> str:
    """A value read by an ``exact`` session, with bytes that were not UTF-8 as ``\\xe9``:
    safe to log and to write back."""
    return value if value.isascii() else original_bytes(value).decode("utf-8", "backslashreplace")


def storable(text: str, encoding: str) -> str:
    """``text`` as a database of ``encoding`` can store it: characters the encoding lacks
    (an ellipsis or a euro sign in a LATIN1 database) become backslash escapes, instead of
    failing the write that records an outcome."""
    if text.isascii():
        return text
    try:
        # A SQL_ASCII database stores what the relay writes, and the relay writes UTF-8.
        codec = "utf-8" if encoding in (UTF8, SQL_ASCII) else pg2pyenc(encoding.encode())
    except psycopg.NotSupportedError:  # an encoding Python has no codec for: keep to ASCII
        codec = "ascii"
    return text.encode(codec, "backslashreplace").decode(codec)
