"""Durations written the way people write them: ``250ms``, ``30s``, ``5m``, ``2h``, ``7d``."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta

from relay.errors import ConfigError, shown

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# ASCII digits only: Python's float() also takes "\u0661" (an Arabic-Indic one), "1_0", "1e300",
# "inf" and "nan", none of which anyone means as a duration.
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
_PLAIN = re.compile(_NUMBER)
_COMPOUND = re.compile(rf"(?:{_NUMBER}(?:ms|s|m|h|d))+")
_PART = re.compile(rf"({_NUMBER})(ms|s|m|h|d)")

# No duration anywhere may be longer than this (about a century). Every option has a
# tighter bound of its own; this one keeps the arithmetic safe: a timedelta ends at
# 999,999,999 days, and "now minus the duration" must stay a valid date (year 1 or later).
MAX_DURATION = timedelta(days=36500)

EXAMPLES = "500ms, 30s, 5m, 1h, 7d"


def is_duration_syntax(value: str) -> bool:
    """Whether ``value`` is written as a duration (whatever its size): ``90``, ``1m30s``."""
    text = value.strip().lower().replace(" ", "")
    return bool(_PLAIN.fullmatch(text) or _COMPOUND.fullmatch(text))


def parse_duration(
    value: str | float | int | timedelta,
    *,
    name: str = "duration",
    minimum: timedelta | None = None,
    maximum: timedelta | None = None,
) -> timedelta:
    """Parse ``value`` into a timedelta.

    Numbers (and strings that are plain numbers) are seconds. Compound forms such as
    ``1m30s`` are accepted. A value that is not a duration, not finite, negative, or
    outside ``minimum``..``maximum`` (and never above :data:`MAX_DURATION`) raises
    :class:`ConfigError` naming the setting, so the CLI can print one clear line.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, str | int | float):
        # TOML hands over booleans, dates, arrays and tables as they are.
        raise ConfigError(f"invalid {name}: {shown(value)} (expected a duration such as {EXAMPLES})")
    elif isinstance(value, int | float):
        seconds = float(value)
    else:
        seconds = _seconds(value, name)
    if not math.isfinite(seconds):
        raise ConfigError(f"invalid {name}: {shown(value)} (must be a finite duration such as {EXAMPLES})")
    if seconds < 0:
        raise ConfigError(f"invalid {name}: {shown(value)} (must not be negative)")
    low = minimum or timedelta(0)
    high = min(maximum, MAX_DURATION) if maximum is not None else MAX_DURATION
    # Compared as seconds, before any timedelta is built: timedelta(seconds=1e300) overflows.
    if seconds < low.total_seconds():
        raise ConfigError(f"invalid {name}: {shown(value)} (must be at least {format_bound(low)})")
    if seconds > high.total_seconds():
        raise ConfigError(f"invalid {name}: {shown(value)} (must be at most {format_bound(high)})")
    return timedelta(seconds=seconds)


def _seconds(value: str, name: str) -> float:
    text = value.strip().lower().replace(" ", "")
    if _PLAIN.fullmatch(text):
        return float(text)  # may be inf for thousands of digits: the caller's check refuses it
    if _COMPOUND.fullmatch(text):
        return math.fsum(float(m.group(1)) * _UNITS[m.group(2)] for m in _PART.finditer(text))
    if text.startswith("-") and is_duration_syntax(text[1:]):
        raise ConfigError(f"invalid {name}: {shown(value)} (must not be negative)")
    raise ConfigError(f"invalid {name}: {shown(value)} (expected a duration such as {EXAMPLES})")


def format_bound(value: timedelta) -> str:
    """A bound as people write it (``10ms``, ``1s``, ``1d``, ``365d``), for errors and --help."""
    ms = round(value.total_seconds() * 1000)
    if ms == 0:
        return "0s"
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


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


def age_text(seconds: float | None) -> str:
    """``3m12s``-style age, or ``-`` when there is nothing to age."""
    return "-" if seconds is None else format_duration(timedelta(seconds=seconds))


def parse_moment(value: str | None, flag: str, now: datetime) -> datetime | None:
    """``value`` as a moment (the operator commands' WHEN): a duration before ``now``
    (``2h``), or an ISO time, local unless it has an offset. None stays None."""
    if value is None:
        return None
    if is_duration_syntax(value):
        # Bounded (at most MAX_DURATION), so "now minus it" stays a valid date.
        return now - parse_duration(value, name=flag)
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise ConfigError(
            f"invalid {flag}: {shown(value)} (expected a duration such as 30m, 2h, 7d, or an ISO time such as"
            " 2024-05-01T12:00+00:00)"
        ) from None
    if parsed.tzinfo:
        return parsed
    try:
        return parsed.astimezone()
    except (ValueError, OverflowError):  # local time at the very ends of years 1 and 9999
        raise ConfigError(
            f"invalid {flag}: {shown(value)} is out of range in the local time zone; give an offset such as +00:00"
        ) from None
