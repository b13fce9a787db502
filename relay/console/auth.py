"""Who may act in the console, and proof that a request came from its own pages.

* **Tokens** (``--token NAME=SECRET`` or ``RELAY_CONSOLE_TOKEN``): an action carries one,
  in its form the first time or as ``Authorization: Bearer SECRET``. Every known token is
  compared with :func:`hmac.compare_digest`, all of them every time, so neither the
  comparison nor the loop tells by its duration how much of a guess was right. The name is
  who the action is recorded as (unless ``--by`` says otherwise).
* **Sessions**: a form that carried a good token gets a session cookie (``HttpOnly``,
  ``SameSite=Strict``), so the confirm step needs no second paste. Sessions live in this
  process only and end after :data:`SESSION_TTL`.
* **Cross-site request forgery**: a write through the session must carry the form field
  :func:`Guard.csrf_for` put in the page, an HMAC of the session under a key that never
  leaves the process, and the browser's ``Origin``, when sent, must be the console's own.
  A page of another site can make the browser send the cookie (not with SameSite=Strict,
  but older browsers differ), never read the field.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta

from relay.dsn import register_secret
from relay.errors import ConfigError

SESSION_TTL = timedelta(hours=8)
MIN_SECRET_CHARS = 16
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")
DEFAULT_NAME = "console"


@dataclass(frozen=True)
class Token:
    name: str
    secret: str = field(repr=False)


def parse_token(value: str, source: str = "--token") -> Token:
    """``NAME=SECRET`` or a bare ``SECRET`` (named :data:`DEFAULT_NAME`); the secret is
    registered with :func:`relay.dsn.mask`, so no log line or page can show it."""
    name, sep, secret = value.partition("=")
    if not sep:
        name, secret = DEFAULT_NAME, value
    elif not _NAME.fullmatch(name):
        raise ConfigError(f"invalid {source}: the name before '=' must be 1-64 letters, digits or _.@- (NAME=SECRET)")
    if len(secret) < MIN_SECRET_CHARS or any(c.isspace() or not c.isprintable() for c in secret):
        raise ConfigError(
            f"invalid {source}: the secret must be at least {MIN_SECRET_CHARS} printable characters without"
            " spaces (for one: openssl rand -hex 16)"
        )
    register_secret(secret)
    return Token(name, secret)


class Guard:
    """The console's tokens, sessions and CSRF key (see the module docstring)."""

    def __init__(self, tokens: tuple[Token, ...], ttl: timedelta = SESSION_TTL) -> None:
        self.tokens = tokens
        self.ttl_s = ttl.total_seconds()
        self._key = secrets.token_bytes(32)
        self._sessions: dict[str, tuple[str, float]] = {}  # session id -> (token name, expires at)

    def check_token(self, given: str | None) -> Token | None:
        """The token ``given`` is, compared with every known one in constant time."""
        if not given:
            return None
        given_b = given.encode("utf-8", "surrogateescape")
        found = None
        for token in self.tokens:
            if hmac.compare_digest(given_b, token.secret.encode()):
                found = token
        return found

    def open_session(self, token: Token) -> str:
        self._expire()
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = (token.name, time.monotonic() + self.ttl_s)
        return sid

    def session_name(self, sid: str | None) -> str | None:
        """Whose session ``sid`` is, while it lasts."""
        if not sid:
            return None
        entry = self._sessions.get(sid)
        if entry is None or entry[1] < time.monotonic():
            self._sessions.pop(sid, None)
            return None
        return entry[0]

    def csrf_for(self, sid: str) -> str:
        return hmac.new(self._key, sid.encode(), "sha256").hexdigest()

    def csrf_ok(self, sid: str, given: str | None) -> bool:
        # As bytes: compare_digest refuses str with characters beyond ASCII (a TypeError,
        # which would be a 500 rather than the refusal it is).
        if not given:
            return False
        return hmac.compare_digest(self.csrf_for(sid).encode(), given.encode("utf-8", "surrogateescape"))

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, (_, until) in self._sessions.items() if until < now]:
            del self._sessions[sid]
