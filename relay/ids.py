"""Outbox ids typed by an operator (`relay dead retry 41`, `relay release --ids 1,2`)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from relay.errors import ConfigError, shown

BIGINT_MAX = 2**63 - 1  # outbox.id is a bigint
# ASCII digits only: str.isdigit() also takes "\u00b2" (superscript two, which int()
# refuses) and "\u0661" (an Arabic-Indic one, which int() reads as 1), and int() takes "1_0".
_ID = re.compile(r"[0-9]{1,19}")


def parse_outbox_id(raw: str, what: str = "id") -> int:
    """``raw`` as an outbox id, or a ConfigError naming ``what`` and quoting ``raw`` cut short."""
    text = raw.strip()
    if not _ID.fullmatch(text) or not 1 <= int(text) <= BIGINT_MAX:
        raise ConfigError(
            f"invalid {what} {shown(raw)}: outbox ids are positive integers (ASCII digits, at most 2^63-1)"
        )
    return int(text)


def parse_id_list(values: Sequence[str], what: str, limit: int) -> list[int]:
    """Comma-separated ids, given once or repeated (``--ids 1,2 --ids 3``), sorted and
    without repeats; a ConfigError for a bad entry or more than ``limit`` ids."""
    ids = {parse_outbox_id(part, f"{what} entry") for value in values for part in value.split(",")}
    if len(ids) > limit:
        raise ConfigError(f"too many {what}: at most {limit:,}")
    return sorted(ids)


def parse_lease_version(raw: str) -> int:
    """``raw`` as a lease_version (a form sends back what a preview showed), or a ConfigError."""
    text = raw.strip()
    if not _ID.fullmatch(text) or int(text) > BIGINT_MAX:
        raise ConfigError(f"invalid lease_version {shown(raw)}: ASCII digits, at most 2^63-1 (preview again)")
    return int(text)
