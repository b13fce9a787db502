"""The HTTP destination's options and their checked form. No aiohttp import here: the CLI
reads every broker's options at start-up, HTTP chosen or not."""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

from relay.adapters.http.signing import parse_secrets
from relay.cloudevents import CloudEvents
from relay.contract import PublishLimits
from relay.dsn import describe_url, register_secret
from relay.errors import ConfigError, shown
from relay.options import Option

SECTION = "http"

# A request may use at most this share of --publish-timeout: the relay cancels the whole
# batch at the publish timeout, and a request that ends first hands back its own outcome.
REQUEST_SHARE_OF_PUBLISH_TIMEOUT = 0.8

OPTIONS: tuple[Option, ...] = (
    Option(
        "url",
        "str",
        None,
        "HTTP destination: each message is one request to this http(s) URL.",
        section=SECTION,
    ),
    Option(
        "http_method",
        "choice",
        "POST",
        "The requests' method.",
        section=SECTION,
        key="method",
        choices=("POST", "PUT", "PATCH"),
    ),
    Option(
        "webhook_secret_file",
        "str",
        None,
        "File of Standard Webhooks signing secrets (whsec_..., one per line; several while"
        " rotating): each request is signed with every one.",
        section=SECTION,
    ),
    Option(
        "webhook_secret",
        "str",
        None,
        "Signing secrets as the file holds them (whitespace-separated); only from the"
        " environment (RELAY_WEBHOOK_SECRET) or the config file, never a flag in a process list.",
        section=SECTION,
        secret=True,
        env_only=True,
    ),
    Option(
        "http_header_file",
        "str",
        None,
        "File of static request headers, 'Name: value' per line (an Authorization, an API key).",
        section=SECTION,
        key="header_file",
    ),
    Option(
        "http_headers",
        "str",
        None,
        "Static request headers as the file holds them ('Name: value' lines); for the"
        " environment (RELAY_HTTP_HEADERS).",
        section=SECTION,
        key="headers",
        secret=True,
        env_only=True,
    ),
    Option(
        "http_timeout",
        "duration",
        None,
        "Deadline of one request, connecting included (default 80% of --publish-timeout).",
        section=SECTION,
        key="timeout",
        minimum=0.01,
        maximum=3600,
    ),
    Option(
        "http_concurrency",
        "int",
        16,
        "Requests in flight at once to one destination (its connection pool's size).",
        section=SECTION,
        key="concurrency",
        minimum=1,
        maximum=1000,
    ),
    Option(
        "http_rate",
        "float",
        0.0,
        "Requests per second to one destination at most (0: no limit), for APIs with quotas.",
        section=SECTION,
        key="rate",
        minimum=0,
        maximum=100_000,
    ),
    Option(
        "http_retry_after_max",
        "duration",
        "10m",
        "Longest wait a Retry-After answer may ask for (a longer one is cut to this), and the"
        " longest that Retry-After answers in a row for one message back off to.",
        section=SECTION,
        key="retry_after_max",
        minimum=1,
        maximum=86_400,
    ),
    Option(
        "http_follow_redirects",
        "bool",
        False,
        "Follow 307 and 308 answers to --url's own origin (at most 10 in a row); any other redirect,"
        " or any at all without it, holds the destination's messages.",
        section=SECTION,
        key="follow_redirects",
    ),
    Option(
        "http_ca_file",
        "str",
        None,
        "CA certificates (PEM) to verify https destinations with, instead of the system's.",
        section=SECTION,
        key="ca_file",
    ),
    Option(
        "http_client_cert",
        "str",
        None,
        "Client certificate (PEM) for mutual TLS; its key in it or in --http-client-key.",
        section=SECTION,
        key="client_cert",
    ),
    Option(
        "http_client_key",
        "str",
        None,
        "Private key (PEM) of --http-client-cert.",
        section=SECTION,
        key="client_key",
    ),
)

# RFC 9110 token characters: what a header name may be made of.
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
# Credentials a producer's row may not carry: the destination's credentials are the
# operator's (static headers, or user info in --url), and a producer's beside them would
# either impersonate another client or make aiohttp refuse the request. Not sent.
PRODUCER_REFUSED_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})
# Headers the relay writes itself: a static header may not stand in for them.
RESERVED_HEADERS = frozenset(
    {"content-type", "content-length", "host", "idempotency-key", "webhook-id", "webhook-timestamp",
     "webhook-signature", "transfer-encoding", "connection"}
)  # fmt: skip


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {shown(path)}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {what} {shown(path)}: not UTF-8 text") from None


def parse_headers(text: str, where: str) -> dict[str, str]:
    """'Name: value' lines (blank lines and '#' comments skipped) as a dict; ConfigError
    naming the line for anything an HTTP request could not carry. The values are
    registered as secrets: an Authorization never reaches a log line."""
    headers: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, colon, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not colon or not _TOKEN.match(name):
            raise ConfigError(f"{where}, line {number}: expected 'Name: value'")
        if name.lower() in RESERVED_HEADERS or name.lower().startswith("relay-"):
            raise ConfigError(f"{where}, line {number}: {name} is written by the relay itself")
        if not value or any(ord(c) < 32 or ord(c) == 127 for c in value) or not value.isascii():
            raise ConfigError(f"{where}, line {number}: the value of {name} must be printable ASCII")
        headers[name] = value
        for secret in credential_parts(name, value):
            register_secret(secret)
    return headers


# An auth scheme and its credentials: "Bearer <token>", "Basic <base64>", "Digest k=v, ...".
_SCHEME_AND_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]*) +(\S.*)")
# Where credentials split into parts: auth-params ("k=v, k=v"), cookie pairs ("a=b; c=d").
_PART_SEPARATORS = re.compile(r"[\s,;]+")
_AUTHORIZATIONS = frozenset({"authorization", "proxy-authorization"})


def credential_parts(name: str, value: str) -> set[str]:
    """What the log mask must know of the static header ``name: value``: the whole value
    (an ``X-Api-Key``), and for credentials every part a receiver could echo alone: an
    Authorization's credentials after its scheme (``Bearer <token>``: the token), each
    auth-param's value, what Basic credentials decode to (``user:password``, and the
    password); a Cookie's values. The scheme's word itself is left out: "Bearer" masked
    everywhere would garble every line."""
    parts = {value}
    lower = name.lower()
    if lower in _AUTHORIZATIONS:
        scheme = _SCHEME_AND_CREDENTIALS.fullmatch(value)
        credentials = scheme.group(2) if scheme else value
        parts |= {credentials, *_pieces(credentials)}
        if scheme and scheme.group(1).lower() == "basic":
            decoded = _base64_text(credentials)
            parts |= {decoded, decoded.partition(":")[2]}
    elif lower == "cookie":
        parts |= _pieces(value)
    return {part for part in parts if part}


def _pieces(credentials: str) -> set[str]:
    """Each ``k=v`` piece of ``credentials``, and its value unquoted."""
    found = set()
    for piece in _PART_SEPARATORS.split(credentials):
        found |= {piece, piece.partition("=")[2].strip('"')}
    return found


def _base64_text(text: str) -> str:
    try:
        return base64.b64decode(text, validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return ""


def check_url(url: str) -> str:
    """``url`` checked: http(s) with a host. Its password and every value of its query
    (an ``api_key=...``) are registered with the log mask, as written and decoded."""
    url = url.strip()
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is no number raises here, not at the first request
    except ValueError:
        raise ConfigError(f"invalid --url {shown(describe_url(url))}: its host or port is malformed") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"invalid --url {shown(describe_url(url))}: expected an http:// or https:// URL")
    secrets = [parts.password or ""]
    for piece in parts.query.split("&"):
        secrets.append(piece.partition("=")[2])
    for secret in secrets:
        register_secret(secret)
        register_secret(unquote_plus(secret))
    return url


def without_credentials(url: str, headers: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """``url`` without its user info, and ``headers`` with the Basic ``Authorization``
    that user info stood for: the relay sends credentials one way only. A static
    Authorization beside user info is refused (which of the two was meant is unknown)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, dict(headers)
    if any(name.lower() == "authorization" for name in headers):
        raise ConfigError(
            "--url carries credentials (user:password@) and the static headers an Authorization:"
            " give the credentials one way only"
        )
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    register_secret(basic)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=host)), {**headers, "Authorization": f"Basic {basic}"}


@dataclass(frozen=True, kw_only=True)
class HttpSettings:
    """Everything the HTTP publisher needs, checked. Build it with :meth:`from_values`,
    which moves credentials in ``url`` (user info) into ``headers`` as a Basic
    Authorization: ``url`` holds none."""

    url: str
    method: str = "POST"
    secrets: tuple[bytes, ...] = field(default=(), repr=False)
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    timeout: timedelta = timedelta(seconds=16)
    concurrency: int = 16
    rate: float = 0.0
    retry_after_max: timedelta = timedelta(minutes=10)
    follow_redirects: bool = False
    ca_file: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    # --envelope cloudevents[-json]: ce- headers (binary) or a structured body (relay.cloudevents).
    cloudevents: CloudEvents | None = None

    @property
    def where(self) -> str:
        """The destination for people: the URL without user info or query (which may hold
        a key)."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> HttpSettings:
        """Check resolved option values; :class:`relay.ConfigError` (one line) for what no
        retry can fix: no URL, an unreadable or malformed secret or header file, a
        request deadline past the publish timeout, a key without its certificate."""
        url = values.get("url")
        if not url:
            raise ConfigError("no destination URL: pass --url, set RELAY_URL, or put url in [http] of the config file")
        secrets_text = values.get("webhook_secret") or ""
        secret_file = values.get("webhook_secret_file")
        if secret_file:
            secrets_text += "\n" + _read(secret_file, "--webhook-secret-file")
        secrets = parse_secrets(secrets_text, "--webhook-secret-file" if secret_file else "RELAY_WEBHOOK_SECRET")
        headers: dict[str, str] = {}
        if values.get("http_headers"):
            headers.update(parse_headers(values["http_headers"], "RELAY_HTTP_HEADERS"))
        if values.get("http_header_file"):
            path = values["http_header_file"]
            headers.update(parse_headers(_read(path, "--http-header-file"), f"--http-header-file {path}"))
        timeout = values.get("http_timeout") or limits.publish_timeout * REQUEST_SHARE_OF_PUBLISH_TIMEOUT
        if timeout > limits.publish_timeout:
            raise ConfigError(
                f"--http-timeout ({timeout.total_seconds():g}s) must end inside --publish-timeout"
                f" ({limits.publish_timeout.total_seconds():g}s)"
            )
        for name in ("http_ca_file", "http_client_cert", "http_client_key"):
            path = values.get(name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"cannot read --{name.replace('_', '-')} {shown(path)}")
        if values.get("http_client_key") and not values.get("http_client_cert"):
            raise ConfigError("--http-client-key needs --http-client-cert")
        url, headers = without_credentials(check_url(str(url)), headers)
        return cls(
            url=url,
            method=values.get("http_method") or "POST",
            secrets=secrets,
            headers=headers,
            timeout=timeout,
            concurrency=int(values.get("http_concurrency") or 16),
            rate=float(values.get("http_rate") or 0.0),
            retry_after_max=values.get("http_retry_after_max") or timedelta(minutes=10),
            follow_redirects=bool(values.get("http_follow_redirects")),
            ca_file=values.get("http_ca_file"),
            client_cert=values.get("http_client_cert"),
            client_key=values.get("http_client_key"),
            cloudevents=limits.cloudevents,
        )
