"""Sizes written the way people write them: ``512KiB``, ``8MiB``, ``10MB``, or a number of bytes.

IEC units are powers of two (``KiB``, ``MiB``, ``GiB``), SI units powers of ten (``kB``,
``MB``, ``GB``); units are case-insensitive. A bare number is bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from relay.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
# ASCII digits only ([0-9], not \d: that would take other scripts' digits), no exponent,
# no sign, so "inf", "nan", "1e300" and "-1" never parse.
_SIZE = re.compile(r"([0-9]{1,20}(?:\.[0-9]{1,20})?) ?([a-z]{0,3})", re.ASCII)
# How much of an unparseable value an error line shows.
_SHOWN = 40


def parse_size(value: object, *, name: str = "size", minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a whole number of bytes within ``[minimum, maximum]``, or ConfigError
    naming the setting (one line for the CLI). Ints and floats (from TOML) are bytes."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"invalid {name}: expected a size such as 512KiB or 8MiB")
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip().lower())
        if match is None or match.group(2) not in _UNITS:
            raise ConfigError(f"invalid {name}: {_show(value)} (expected a size such as 512KiB, 8MiB or 10MB)")
        amount = Decimal(match.group(1)) * _UNITS[match.group(2)]
    else:
        try:
            amount = Decimal(value)
        except (InvalidOperation, ValueError):
            raise ConfigError(f"invalid {name}: {value!r} (expected a size such as 512KiB or 8MiB)") from None
        if not amount.is_finite() or amount < 0:
            raise ConfigError(f"invalid {name}: {value!r} (expected a size such as 512KiB or 8MiB)")
    if amount != amount.to_integral_value():
        raise ConfigError(f"invalid {name}: {_show(value)} is not a whole number of bytes")
    size = int(amount)
    if size < minimum:
        raise ConfigError(f"invalid {name}: {_show(value)} (must be at least {format_size(minimum)})")
    if maximum is not None and size > maximum:
        raise ConfigError(f"invalid {name}: {_show(value)} (must be at most {format_size(maximum)})")
    return size


def format_size(size: int) -> str:
    """The shortest exact form of ``size``: ``8MiB``, ``1500kB``, ``12345B``."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("GB", 1000**3), ("MB", 1000**2)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    if size >= 1000 and size % 1000 == 0:
        return f"{size // 1000}kB"
    return f"{size}B"


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"
