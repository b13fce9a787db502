"""An HTTP answer (or the lack of one) sorted into the relay's failure classes.

- 2xx: delivered.
- 408, 409 (the same Idempotency-Key still in progress), 425, 429, 500, 502, 503, 504,
  any other 5xx but 501 and 505, a timeout, a connection reset or closed mid-request:
  **retryable**, the attempt counts, full-jitter backoff. With a ``Retry-After`` (seconds
  or an HTTP date) the destination said when to come back: the message waits that long
  (at most ``--http-retry-after-max``) and the attempt is **refunded** (the relay's
  Defer), so a destination that throttles never sends messages to dead; ``--defer-max-age``
  bounds how long a message may be put off that way.
- 401: the credentials (a static Authorization) are wrong for every message:
  **destination unavailable**, held without spending attempts.
- 3xx without ``--http-follow-redirects``: the URL is not where the destination is:
  **destination unavailable**, held, the Location said in the error.
- Connection refused, a DNS failure, a TLS handshake or certificate failure: **destination
  unavailable**, held, no attempt spent.
- Any other 4xx, 501, 505: **permanent**, dead at once, with the status and the first
  bytes of the answer (masked, cut) in ``last_error``.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Mapping
from datetime import timedelta

from relay.dsn import mask
from relay.errors import BrokerUnavailable, Defer, PermanentError, RetryableError

# How much of an error answer's body last_error keeps.
BODY_SHOWN_BYTES = 200
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
PERMANENT_5XX = frozenset({501, 505})


def shown_body(body: bytes) -> str:
    """The first bytes of an answer for ``last_error``: decoded leniently, control
    characters replaced, secrets masked, cut (``...`` says so)."""
    text = body[:BODY_SHOWN_BYTES].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    if len(body) > BODY_SHOWN_BYTES:
        text += "..."
    return mask(text)


def retry_after(value: str | None, cap: timedelta, now: float | None = None) -> timedelta | None:
    """``Retry-After`` as a wait: delay-seconds or an HTTP date; None when absent or
    unreadable; never below zero, never above ``cap``."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        wait = float(value)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        wait = when.timestamp() - (time.time() if now is None else now)
    return min(timedelta(seconds=max(wait, 0.0)), cap)


def classify_status(
    status: int, headers: Mapping[str, str], body: bytes, *, where: str, cap: timedelta
) -> BaseException | None:
    """The outcome of an answer with ``status``."""
    if 200 <= status < 300:
        return None
    said = f"{where} answered {status}"
    if 300 <= status < 400:
        location = headers.get("Location", "")
        return BrokerUnavailable(
            f"{said}, a redirect to {mask(location)[:200]!r}: set --url to it, or --http-follow-redirects"
        )
    if status == 401:
        return BrokerUnavailable(f"{said} (unauthorized): check the destination's credentials; {shown_body(body)}")
    if status in RETRYABLE_STATUSES or (status >= 500 and status not in PERMANENT_5XX):
        wait = retry_after(headers.get("Retry-After"), cap)
        if wait is not None:
            return Defer(wait, f"{said} with Retry-After {headers.get('Retry-After')}: {shown_body(body)}")
        return RetryableError(f"{said}: {shown_body(body)}")
    return PermanentError(f"{said}: {shown_body(body)}")
