"""Describing a PostgreSQL or broker address without ever showing its password, and
masking passwords out of any text the relay prints or stores.

:func:`mask` runs on every log line, every error message and every ``last_error``, so it
must be linear in the length of its input whatever that input is: it makes a few passes,
each moving forward only, and uses no pattern that is retried from every position (the
regular expression it replaces took 10 s on a 40,000-character line). It hides:

* the password of anything shaped like a URL's user info, ``user:password@``, with or
  without a scheme and however malformed (``amqp//u:pw@h``, ``amqp:/u:pw@h``, an
  unencoded ``/`` or ``@`` in the password): everything from the separating colon up to
  the last ``@`` of the word (text between whitespace) is replaced;
* the value of ``password=...`` in a ``key=value`` connection string, quoted or not;
* every secret the process knows (:func:`remember_secrets`: the passwords of the
  configured DSN and broker URL, and pieces of them; the AWS secret key), wherever it
  appears, literally. This catches what no pattern can, such as a client library quoting a
  malformed URL's port, which was really part of the password.

It errs on the side of hiding too much: a word such as ``a:b@c`` loses its ``b``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from psycopg.conninfo import conninfo_to_dict

from relay.errors import ConfigError
from relay.textsafe import clip, escape

MASK = "***"

# Known secrets shorter than this are left to the patterns: short strings occur in ordinary
# text (user names, words, numbers), and replacing every "guest" would garble log lines.
MIN_SECRET_CHARS = 6

# The secrets mask() replaces literally, longest first (so a password is replaced whole,
# not piece by piece). Replaced as a whole tuple, never mutated, so readers need no lock.
_secrets: tuple[str, ...] = ()

_SPACE = re.compile(r"(\s+)")
_KEYWORD_EQUALS = re.compile(r"\s*=\s*")
_QUOTED = re.compile(r"'[^'\\]*(?:\\.[^'\\]*)*'", re.DOTALL)
_NOT_SPACE = re.compile(r"\S*")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

# What a host name or IP address may contain (IPv6 as urlsplit/libpq give it: no brackets,
# maybe a %zone). Checked before a host is ever printed: a password with an unencoded "/"
# or "@" ends up parsed as the host or port.
_HOST = re.compile(r"[A-Za-z0-9._~%:-]{1,255}")
# A PostgreSQL Unix-socket directory (or, from PostgreSQL 14, "@name" for an abstract socket).
_SOCKET_DIR = re.compile(r"[/@][^@:\s]{0,1000}")
_PORT = re.compile(r"[0-9]{1,5}")

ENCODE_HINT = "percent-encode '@', '/', ':', '?' and '#' in the user name and password (%40, %2F, %3A, %3F, %23)"


def mask(text: str) -> str:
    """``text`` with every password in it replaced by ``***`` (see the module docstring)."""
    if "@" in text:
        text = "".join(_mask_word(w) if "@" in w else w for w in _SPACE.split(text))
    if "=" in text:
        text = _mask_keywords(text)
    # Known secrets last: replacing one first could break up the "password=" or "user:pw@"
    # that the passes above look for. A replacement can only form a new occurrence out of
    # the "***" it wrote, so the loop runs more than once only for a secret holding "*".
    for secret in _secrets:
        while secret in text:
            text = text.replace(secret, MASK)
    return text


def _mask_word(word: str) -> str:
    """Hide the password in one whitespace-free word holding an ``@``: everything between
    the user info's colon and the word's last ``@``."""
    at = word.rfind("@")
    head = word[:at]
    colon = head.find(":")
    if colon < 0:
        return word  # a user name or an e-mail address: nothing secret
    if colon > 0 and head[colon - 1].isalnum() and head.startswith("://", colon):
        # A scheme: the user info starts after it.
        colon = head.find(":", colon + 3)
        if colon < 0:
            return word  # scheme://user@host, no password
    return head[: colon + 1] + MASK + word[at:]


def _mask_keywords(text: str) -> str:
    """Hide the value of every ``password = value`` (libpq's keyword form). Each step
    starts where the previous one ended, so the whole is one pass over ``text``."""
    lowered = text.translate(_ASCII_LOWER)  # same length as text, unlike str.lower()
    out: list[str] = []
    done = 0
    at = lowered.find("password")
    while at >= 0:
        equals = _KEYWORD_EQUALS.match(text, at + len("password"))
        if equals is None:
            at = lowered.find("password", at + len("password"))
            continue
        start = equals.end()
        if text.startswith("'", start):
            quoted = _QUOTED.match(text, start)
            # An unterminated quote: hide the rest, rather than look for its end again
            # from every later "password" (which would make this quadratic).
            end = quoted.end() if quoted else len(text)
        else:
            value = _NOT_SPACE.match(text, start)
            end = value.end() if value else start
        if end > start:
            out += [text[done:start], MASK]
            done = end
        at = lowered.find("password", max(end, at + len("password")))
    out.append(text[done:])
    return "".join(out)


def register_secret(secret: str) -> None:
    """Have :func:`mask` replace ``secret`` wherever it appears (if it is long enough to
    be told apart from ordinary text, see MIN_SECRET_CHARS)."""
    global _secrets
    if len(secret) < MIN_SECRET_CHARS or secret in _secrets:
        return
    _secrets = tuple(sorted((*_secrets, secret), key=len, reverse=True))


def remember_secrets(value: str) -> None:
    """Register the password inside ``value``, a DSN or URL from configuration, with
    :func:`mask`: as written, percent-decoded, and its pieces between ``@``, ``/`` and
    ``:`` (a malformed URL gets split there by parsers, and a piece can surface alone)."""
    found: set[str] = set()
    users: set[str] = set()
    # What mask() itself hides in a URL: from the user info's colon to the last "@".
    if "@" in value:
        head = value[: value.rfind("@")]
        scheme = head.find("://")
        start = scheme + 3 if scheme >= 0 else 0
        colon = head.find(":", start)
        if colon >= 0:
            found.add(head[colon + 1 :])
            users.add(head[start:colon])
    try:
        parts = urlsplit(value)
        if parts.password:
            found.add(parts.password)
        if parts.username:
            users.add(parts.username)
    except ValueError:
        pass
    try:
        params = conninfo_to_dict(value)
        if params.get("password"):
            found.add(str(params["password"]))
        if params.get("user"):
            users.add(str(params["user"]))
    except Exception:  # not a PostgreSQL connection string: the URL readings above remain
        pass
    for secret in list(found):
        found.add(unquote(secret))
    for secret in list(found):
        found.update(re.split(r"[@/:?#]", secret))
    # A password equal to the user name is shown with the user name anyway; masking it
    # everywhere would only hide the user from every message.
    users |= {unquote(u) for u in users}
    for secret in found - users:
        register_secret(secret)


def url_problem(url: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with ``url`` as a ``scheme://user:password@host:port/path`` URL of one
    of ``schemes``, in words that quote none of it; None if nothing is."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        return "it does not start with " + " or ".join(f"{s}://" for s in schemes)
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    if "@" in rest[cut:]:
        return f"an '@' after the host: {ENCODE_HINT}"
    # More than one "@" before the host is left alone: urlsplit and yarl (aio-pika) both
    # end the user info at the last one, so the URL means what its writer meant.
    try:
        parts = urlsplit(url)
        host, _port = parts.hostname, parts.port
    except ValueError:
        return f"the host or port is malformed (a port must be a number): {ENCODE_HINT}"
    if not host:
        return "no host"
    if not _HOST.fullmatch(host):
        return f"the host is not a host name or IP address: {ENCODE_HINT}"
    return None


def describe_url(url: str) -> str:
    """``scheme://user@host:port/path`` for messages: the password dropped, and nothing
    shown that did not parse as what it should be (a malformed URL is not shown at all)."""
    scheme = url.partition("://")[0].lower()
    if url_problem(url, (scheme,)) is not None:
        return "(a malformed URL, not shown)"
    parts = urlsplit(url)
    user = f"{escape(clip(parts.username, 100))}@" if parts.username else ""
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    port = f":{parts.port}" if parts.port else ""
    path = escape(clip(parts.path, 200)) if ":" not in parts.path else "/…"
    return f"{parts.scheme}://{user}{host}{port}{path}"


def describe_dsn(dsn: str) -> str:
    """``host H:P database 'D' user 'U'`` for messages (``hosts H1:P1,H2:P2 ...`` for a
    multi-host DSN, each host with its own port; ``socket /dir/.s.PGSQL.P`` for a Unix
    socket, as libpq names it), or a ConfigError saying what is
    wrong with a malformed DSN. Neither ever quotes the DSN: the parser's own message can,
    and a password with an unencoded ``/`` or ``@`` gets parsed as the host, the port or
    the database, so each part is checked before it is shown."""
    problem = _pg_url_problem(dsn)
    if problem is not None:
        raise ConfigError(f"invalid --dsn: {problem}")
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        raise ConfigError("invalid --dsn: not a PostgreSQL connection string or URL") from None
    dbname = escape(clip(str(params.get("dbname") or params.get("user") or "(default)"), 200))
    user = f" user {escape(clip(str(params['user']), 100))!r}" if params.get("user") else ""
    servers = _servers(params)
    shown = ",".join(where for where, _ in servers[:MAX_SHOWN_SERVERS])
    if len(servers) > MAX_SHOWN_SERVERS:
        shown += f",... ({len(servers)} in all)"
    sockets = sum(1 for _, socket in servers if socket)
    kind = "socket" if sockets == len(servers) else "host" if not sockets else "server"
    return f"{kind}{'' if len(servers) == 1 else 's'} {shown} database {dbname!r}{user}"


# Servers a description names before it says how many there are in all: a DSN lists a
# primary and a few standbys; the line stays short whatever it lists.
MAX_SHOWN_SERVERS = 10


def _servers(params: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """Each server a multi-host DSN names, as libpq pairs them: the i-th host with the i-th
    hostaddr and the i-th port (or the one port, for every host), each part absent from the
    DSN taken from libpq's environment (PGHOST, PGHOSTADDR, PGPORT) as libpq takes it.
    ``host:port``, ``[ipv6]:port``; ``name:port (hostaddr A)`` where both are given (libpq
    connects to A and authenticates as name); and whether it is a Unix socket, which libpq
    names ``/socket/dir/.s.PGSQL.port``. With neither host nor hostaddr, libpq connects to
    the socket in the directory it was built with (PostgreSQL's default for the build, not
    known before connecting), except on Windows, where it connects to localhost."""
    hosts, addrs, ports = (_listed(params, key) for key in ("host", "hostaddr", "port"))
    count = len(hosts) or len(addrs) or 1
    if hosts and addrs and len(hosts) != len(addrs):
        raise ConfigError(f"invalid --dsn: {len(hosts)} hosts and {len(addrs)} hostaddr values: give one per host")
    if len(ports) not in (0, 1, count):
        raise ConfigError(f"invalid --dsn: {len(ports)} ports for {count} hosts: give one port, or one per host")
    servers = []
    for i in range(count):
        host = hosts[i] if hosts else ""
        addr = addrs[i] if addrs else ""
        port = (ports[i] if len(ports) == count else ports[0] if ports else "") or DEFAULT_PORT
        if host and not (_HOST.fullmatch(host) or _SOCKET_DIR.fullmatch(host)):
            raise ConfigError(
                f"invalid --dsn: the host is not a host name, an IP address or a socket directory: {ENCODE_HINT}"
            )
        if addr and not _HOST.fullmatch(addr):
            raise ConfigError(f"invalid --dsn: the hostaddr is not an IP address: {ENCODE_HINT}")
        if not _PORT.fullmatch(port):
            raise ConfigError(f"invalid --dsn: the port is not a number: {ENCODE_HINT}")
        if addr:  # libpq connects to the address, over TCP, whatever the host says
            where = f"{_bracketed(host or addr)}:{port}"
            servers.append((escape(f"{where} (hostaddr {addr})" if host else where), False))
        elif host and _SOCKET_DIR.fullmatch(host):
            servers.append((escape(f"{host.rstrip('/')}/.s.PGSQL.{port}"), True))
        elif host or os.name == "nt":
            servers.append((escape(f"{_bracketed(host or 'localhost')}:{port}"), False))
        else:
            servers.append((f".s.PGSQL.{port} (libpq's default directory)", True))
    return servers


# The port libpq uses when neither the DSN nor PGPORT gives one.
DEFAULT_PORT = "5432"
_ENVIRONMENT = {"host": "PGHOST", "hostaddr": "PGHOSTADDR", "port": "PGPORT"}


def _listed(params: Mapping[str, Any], key: str) -> list[str]:
    value = str(params.get(key) or os.environ.get(_ENVIRONMENT[key], ""))
    return value.split(",") if value else []


def _bracketed(host: str) -> str:
    """An IPv6 address in brackets, so that its port cannot be read as one more group."""
    return f"[{host}]" if ":" in host and not _SOCKET_DIR.fullmatch(host) else host


def _pg_url_problem(dsn: str) -> str | None:
    """What libpq would misread in a ``postgresql://`` URL without saying so: it looks for
    the user info's ``@`` only before the first ``/``, so a password holding a ``/`` makes
    the rest of it the port and the database (``postgres:S3cr3t/PW_xyz@host/db``)."""
    if not dsn.startswith(("postgresql://", "postgres://")):
        return None
    rest = dsn.partition("://")[2]
    slash = rest.find("/")
    if slash >= 0 and "@" in rest[slash:].partition("?")[0]:
        return f"an '@' after the host: {ENCODE_HINT}"
    return None
