"""An HTTP answer (or the lack of one) sorted into the relay's failure classes.

- 2xx: delivered.
- 408, 409 (the same Idempotency-Key still in progress), 425, 429, 500, 502, 503, 504,
  any other 5xx but 501 and 505, a timeout, a connection reset or closed mid-request:
  **retryable**, the attempt counts, full-jitter backoff. With a ``Retry-After`` (seconds
  or an HTTP date) the destination said when to come back: the message waits that long
  (at most ``--http-retry-after-max``) and the attempt is **refunded** (the relay's
  Defer), so a destination that throttles never sends messages to dead; ``--defer-max-age``
  bounds how long a message may be put off that way. An unreadable ``Retry-After`` is
  taken as absent; a short one is lengthened (:mod:`relay.adapters.http.deferrals`).
- 401: the credentials (a static Authorization) are wrong for every message:
  **destination unavailable**, held without spending attempts.
- 3xx without ``--http-follow-redirects``: the URL is not where the destination is:
  **destination unavailable**, held, the Location said in the error (without its query).
  With it, see :mod:`relay.adapters.http.redirects`.
- Connection refused, a DNS failure, a TLS handshake or certificate failure: **destination
  unavailable**, held, no attempt spent.
- Any other 4xx, 501, 505: **permanent**, dead at once, with the status and the first
  bytes of the answer (masked, cut) in ``last_error``.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from datetime import timedelta

from relay.adapters.http.redirects import unfollowed
from relay.dsn import mask
from relay.errors import BrokerUnavailable, Defer, PermanentError, RetryableError
from relay.textsafe import clip, escape

# How much of an error answer's body last_error keeps.
BODY_SHOWN_BYTES = 200
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
PERMANENT_5XX = frozenset({501, 505})
# How much of a Retry-After a line repeats (an HTTP date is 29 characters).
RETRY_AFTER_SHOWN_CHARS = 40


def shown_body(body: bytes) -> str:
    """The first bytes of an answer for ``last_error``: decoded leniently, control
    characters replaced, secrets masked, cut (``...`` says so)."""
    text = body[:BODY_SHOWN_BYTES].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    if len(body) > BODY_SHOWN_BYTES:
        text += "..."
    return mask(text)


# Retry-After's delay-seconds (RFC 9110, 10.2.3): ASCII digits only. str.isdigit() also
# takes "²" and other Unicode digits, which int() and float() then refuse.
_DELAY_SECONDS = re.compile(r"[0-9]+", re.ASCII)
# Digits beyond this many are a wait past any cap (10**12 s is 30,000 years): not turned
# into a number at all, so that no length of digits costs time or overflows.
_MAX_DIGITS = 12


def retry_after(value: str | None, cap: timedelta, now: float | None = None) -> timedelta | None:
    """``Retry-After`` as a wait: delay-seconds (ASCII digits) or an HTTP date; None when
    absent or unreadable (then the answer is taken as if it had none); never below zero,
    never above ``cap``, and cut to ``cap`` before any timedelta is built from it, so no
    value can overflow."""
    if not value:
        return None
    value = value.strip()
    wait: float | None
    if _DELAY_SECONDS.fullmatch(value):
        digits = value.lstrip("0") or "0"
        wait = cap.total_seconds() if len(digits) > _MAX_DIGITS else float(int(digits))
    else:
        wait = _until_date(value, time.time() if now is None else now)
        if wait is None:
            return None
    return timedelta(seconds=min(max(wait, 0.0), cap.total_seconds()))


def _until_date(value: str, now: float) -> float | None:
    """Seconds from ``now`` to the HTTP date ``value``; None when it is none (the parser
    raises several types for malformed dates, and a year past 9999 overflows)."""
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            return None
        return when.timestamp() - now
    except (TypeError, ValueError, IndexError, OverflowError, OSError):
        return None


def classify_status(
    status: int, headers: Mapping[str, str], body: bytes, *, where: str, cap: timedelta, url: str = ""
) -> BaseException | None:
    """The outcome of an answer with ``status`` to a request to ``url`` (which a relative
    Location is read against)."""
    if 200 <= status < 300:
        return None
    said = f"{where} answered {status}"
    if 300 <= status < 400:
        return unfollowed(status, headers, url, where=where)
    if status == 401:
        return BrokerUnavailable(f"{said} (unauthorized): check the destination's credentials; {shown_body(body)}")
    if status in RETRYABLE_STATUSES or (status >= 500 and status not in PERMANENT_5XX):
        asked = headers.get("Retry-After", "").strip()
        wait = retry_after(asked, cap)
        shown_asked = escape(clip(asked, RETRY_AFTER_SHOWN_CHARS))
        if wait is not None:
            return Defer(wait, f"{said} with Retry-After {shown_asked}: {shown_body(body)}")
        if asked:
            said += f" with a Retry-After that is neither a delay nor a date ('{shown_asked}', ignored)"
        return RetryableError(f"{said}: {shown_body(body)}")
    return PermanentError(f"{said}: {shown_body(body)}")
