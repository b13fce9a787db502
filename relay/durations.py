"""Durations written the way people write them: ``250ms``, ``30s``, ``5m``, ``2h``, ``7d``."""

from __future__ import annotations

import re
from datetime import timedelta

from relay.errors import ConfigError

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: str | float | int | timedelta, *, name: str = "duration") -> timedelta:
    """Parse ``value`` into a timedelta.

    Numbers (and strings that are plain numbers) are seconds. Compound forms such as
    ``1m30s`` are accepted. Negative or unparseable values raise :class:`ConfigError`
    naming the setting, so the CLI can print one clear line.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ConfigError(f"invalid {name}: {value!r} (expected a duration such as 500ms, 30s, 5m)")
    elif isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        try:
            seconds = float(text)
        except ValueError:
            pos, seconds = 0, 0.0
            for match in _PART.finditer(text):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if pos != len(text) or not text:
                raise ConfigError(
                    f"invalid {name}: {value!r} (expected a duration such as 500ms, 30s, 5m, 1h, 7d)"
                ) from None
    if seconds < 0:
        raise ConfigError(f"invalid {name}: {value!r} (must not be negative)")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """The shortest readable form of ``value``, for logs and status output."""
    seconds = value.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s".replace(".0s", "s")
    if seconds < 7200:
        return f"{seconds / 60:.1f}m".replace(".0m", "m")
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h".replace(".0h", "h")
    return f"{seconds / 86400:.1f}d".replace(".0d", "d")
