"""Outbox ids typed by an operator (`relay dead retry 41`, `relay release --ids 1,2`)."""

from __future__ import annotations

import re

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


def parse_lease_version(raw: str) -> int:
    """``raw`` as a lease_version (a form sends back what a preview showed), or a ConfigError."""
    text = raw.strip()
    if not _ID.fullmatch(text) or int(text) > BIGINT_MAX:
        raise ConfigError(f"invalid lease_version {shown(raw)}: ASCII digits, at most 2^63-1 (preview again)")
    return int(text)
