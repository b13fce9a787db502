"""The NATS JetStream destination's options and their checked form, and the subject
template. No nats-py import here: the CLI reads every broker's options at start-up."""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from relay.cloudevents import CloudEvents
from relay.contract import PublishLimits
from relay.dsn import describe_url
from relay.errors import ConfigError, shown
from relay.message import OutboxMessage
from relay.options import Option

SECTION = "nats"

# A publish may wait for its acknowledgement at most this share of --publish-timeout.
REQUEST_SHARE_OF_PUBLISH_TIMEOUT = 0.8
# The fields a subject template may name.
SUBJECT_FIELDS = ("aggregate_type", "aggregate_id", "event_type")
# A subject's token: no whitespace, no wildcard ('*', '>'), not empty (NATS's rules for a
# subject one publishes to).
_TOKEN = re.compile(r"^[^\s*>.]+$")
# What a field's value may not hold: a token separator, a wildcard, whitespace or another
# control character (the subject goes on the protocol's command line).
_NOT_IN_FIELD = re.compile(r"[.*>\s\x00-\x1f\x7f]")

OPTIONS: tuple[Option, ...] = (
    Option(
        "nats_url",
        "str",
        None,
        "NATS server(s), nats://[user:password@]HOST:4222[,nats://...] (tls:// for TLS).",
        section=SECTION,
        key="url",
        secret=True,
    ),
    Option(
        "subject",
        "str",
        None,
        "JetStream subject to publish to; may name {aggregate_type}, {aggregate_id} and"
        " {event_type} (orders.{event_type}). A stream must capture it.",
        section=SECTION,
    ),
    Option(
        "nats_creds_file",
        "str",
        None,
        "NATS user credentials file (JWT and NKey seed) for servers that want one.",
        section=SECTION,
        key="creds_file",
    ),
    Option(
        "nats_ca_file",
        "str",
        None,
        "CA certificates (PEM) to verify a tls:// server with, instead of the system's.",
        section=SECTION,
        key="ca_file",
    ),
)


def _tokens_valid(subject: str) -> bool:
    return all(_TOKEN.match(token) for token in subject.split("."))


@dataclass(frozen=True)
class SubjectTemplate:
    """``--subject``: a subject, or a template naming the message's fields."""

    text: str

    def __post_init__(self) -> None:
        try:
            parsed = list(string.Formatter().parse(self.text))
        except ValueError as exc:
            raise ConfigError(f"invalid --subject {shown(self.text)}: {exc}") from None
        for _literal, field_name, spec, conversion in parsed:
            if field_name is None:
                continue
            if field_name not in SUBJECT_FIELDS or spec or conversion:
                raise ConfigError(
                    f"invalid --subject {shown(self.text)}: {{{field_name}}} is not one of"
                    f" {', '.join('{' + f + '}' for f in SUBJECT_FIELDS)}"
                )
        sample = self.text.format(**dict.fromkeys(SUBJECT_FIELDS, "x"))
        if not sample or not _tokens_valid(sample):
            raise ConfigError(
                f"invalid --subject {shown(self.text)}: tokens separated by '.', none empty,"
                " without spaces or the wildcards '*' and '>'"
            )

    @property
    def static(self) -> bool:
        return "{" not in self.text

    def render(self, m: OutboxMessage) -> str:
        """The message's subject, each field's value inside the token the template puts it
        in. ValueError, naming the field, its value and the template, when a value would
        add a token (a '.'), make a wildcard ('*', '>'), hold whitespace or a control
        character, or leave a token empty: that message alone is refused, never sent to a
        subject of another tree (``orders.{aggregate_id}`` with the id ``x.y`` would be
        ``orders.x.y``, another aggregate's subtree under a ``orders.>`` stream)."""
        if self.static:
            return self.text
        fields = {"aggregate_type": m.aggregate_type, "aggregate_id": m.aggregate_id, "event_type": m.event_type}
        for name, value in fields.items():
            if "{" + name + "}" in self.text and _NOT_IN_FIELD.search(value):
                raise ValueError(
                    f"{name} {shown(value)} cannot go into subject template {self.text!r}: a field's value"
                    " must stay one subject token (no '.', '*', '>', whitespace or control characters)"
                )
        subject = self.text.format(**fields)
        if not _tokens_valid(subject):
            raise ValueError(
                f"subject template {self.text!r} makes an empty token of this message's fields"
                f" ({', '.join(f'{k} {shown(v)}' for k, v in fields.items() if '{' + k + '}' in self.text)})"
            )
        return subject


@dataclass(frozen=True, kw_only=True)
class NatsSettings:
    """Everything the NATS publisher needs, checked. Build it with :meth:`from_values`."""

    servers: tuple[str, ...]
    subject: SubjectTemplate
    request_timeout: timedelta = timedelta(seconds=16)
    creds_file: str | None = None
    ca_file: str | None = None
    # --envelope cloudevents[-json]: ce- headers (binary) or a structured body (relay.cloudevents).
    cloudevents: CloudEvents | None = None

    @property
    def where(self) -> str:
        return f"NATS subject {self.subject.text!r} at {','.join(describe_url(s) for s in self.servers)}"

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> NatsSettings:
        """Check resolved option values; :class:`relay.ConfigError` (one line) for what no
        retry can fix: no server or subject, a malformed one, an unreadable file."""
        text = (values.get("nats_url") or "").strip()
        if not text:
            raise ConfigError(
                "no NATS server: pass --nats-url, set RELAY_NATS_URL, or put url in [nats] of the config file"
            )
        servers = tuple(s.strip() for s in text.split(",") if s.strip())
        for server in servers:
            parts = urlsplit(server)
            if parts.scheme not in ("nats", "tls") or not parts.hostname:
                raise ConfigError(f"invalid --nats-url {shown(describe_url(server))}: expected nats://HOST:PORT")
        subject = (values.get("subject") or "").strip()
        if not subject:
            raise ConfigError(
                "no subject: pass --subject, set RELAY_SUBJECT, or put subject in [nats] of the config file"
            )
        for name in ("nats_creds_file", "nats_ca_file"):
            path = values.get(name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"cannot read --{name.replace('_', '-')} {shown(path)}")
        return cls(
            servers=servers,
            subject=SubjectTemplate(subject),
            request_timeout=limits.publish_timeout * REQUEST_SHARE_OF_PUBLISH_TIMEOUT,
            creds_file=values.get("nats_creds_file"),
            ca_file=values.get("nats_ca_file"),
            cloudevents=limits.cloudevents,
        )
