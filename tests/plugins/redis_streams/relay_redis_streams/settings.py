"""The destination's options, and the settings checked from them (no redis-py import)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from relay import ConfigError, Option, PublishLimits

SECTION = "redis-streams"
# Redis's own ceiling for one value (proto-max-bulk-len) is 512 MiB; a stream entry that
# large would hold a consumer's memory, so the relay refuses past 1 MiB unless told more.
DEFAULT_MAX_MESSAGE_BYTES = 1_048_576
# A command should answer well inside the relay's publish timeout: past this share of it,
# the relay cuts the publish off itself and the entry may or may not be there.
COMMAND_SHARE_OF_PUBLISH_TIMEOUT = 0.8

OPTIONS: tuple[Option, ...] = (
    Option(
        "redis_url",
        "str",
        None,
        "Redis to deliver to: redis://[user:password@]host:port/db (rediss:// for TLS).",
        section=SECTION,
        key="url",
        secret=True,
        nonempty=True,
    ),
    Option(
        "stream",
        "str",
        None,
        "The stream each message is added to (XADD); it must exist.",
        section=SECTION,
        nonempty=True,
    ),
    Option(
        "redis_max_message_size",
        "int",
        DEFAULT_MAX_MESSAGE_BYTES,
        "Bytes of payload and fields one entry may take; a larger message goes to dead.",
        section=SECTION,
        key="max_message_size",
        minimum=1024,
        maximum=512 * 1024 * 1024,
    ),
)


@dataclass(frozen=True)
class RedisStreamsSettings:
    """Where entries go, and how long a command may take."""

    url: str
    stream: str
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    command_timeout_s: float = 16.0

    @property
    def where(self) -> str:
        """``stream 'orders' at redis://host:6379/0``: the URL without its password."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"stream {self.stream!r} at {parts.scheme}://{host}{port}{parts.path}"

    @classmethod
    def from_values(cls, values: Mapping[str, Any], limits: PublishLimits) -> RedisStreamsSettings:
        """Check resolved option values; :class:`relay.ConfigError` on a bad one."""
        url = (values.get("redis_url") or "").strip()
        if not url:
            raise ConfigError("no Redis: pass --redis-url, set RELAY_REDIS_URL, or put url in [redis-streams]")
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("invalid --redis-url: expected redis://host:port/db, rediss://... or unix://...")
        stream = (values.get("stream") or "").strip()
        if not stream:
            raise ConfigError("no stream: pass --stream, set RELAY_STREAM, or put stream in [redis-streams]")
        return cls(
            url=url,
            stream=stream,
            max_message_bytes=int(values.get("redis_max_message_size") or DEFAULT_MAX_MESSAGE_BYTES),
            command_timeout_s=limits.publish_timeout.total_seconds() * COMMAND_SHARE_OF_PUBLISH_TIMEOUT,
        )
