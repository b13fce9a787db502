"""The HTTP destination's options and their checked form. No aiohttp import here: the CLI
reads every broker's options at start-up, HTTP chosen or not."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from relay.adapters.http.signing import parse_secrets
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
        "Longest wait a Retry-After answer may ask for; a longer one is cut to this.",
        section=SECTION,
        key="retry_after_max",
        minimum=1,
        maximum=86_400,
    ),
    Option(
        "http_follow_redirects",
        "bool",
        False,
        "Follow 3xx answers (at most 10); without it a redirect holds the destination's messages.",
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
        register_secret(value)
    return headers


def check_url(url: str) -> str:
    url = url.strip()
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"invalid --url {shown(describe_url(url))}: expected an http:// or https:// URL")
    if parts.password:
        register_secret(parts.password)
    return url


@dataclass(frozen=True, kw_only=True)
class HttpSettings:
    """Everything the HTTP publisher needs, checked. Build it with :meth:`from_values`."""

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
        return cls(
            url=check_url(str(url)),
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
        )
