"""Which redirects the HTTP destination follows, and how it names their targets.

A redirect is followed (with ``--http-follow-redirects``) only when it keeps the request
as it was sent and stays where the relay's credentials belong:

- 307 and 308 keep the method and the body; 301, 302 and 303 let (or make) a client turn
  the POST into a body-less GET, whose 2xx would mark an event delivered that reached no
  endpoint. Those hold the message instead.
- only to the same origin as ``--url`` (scheme, host and port): the static headers (an
  ``Authorization``, an ``X-Api-Key``) and the signed body go nowhere else.

Anything else holds the message as a configuration fault (``BrokerUnavailable``: no
attempt spent) with a line naming the target. A target is named without its user info,
query or fragment: a query may hold a key too short to be masked literally wherever it
appears, so it is never shown at all.

No aiohttp here: this is plain URL arithmetic, unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit

from relay.dsn import mask
from relay.errors import BrokerUnavailable
from relay.textsafe import clip, escape

# Redirects in a row a message follows before it is held: what browsers and aiohttp allow.
MAX_REDIRECTS = 10
# The statuses that keep the method and the body (RFC 9110, 15.4.8 and 15.4.9).
FOLLOWED_STATUSES = frozenset({307, 308})
# How much of a target a line shows.
SHOWN_URL_CHARS = 200
DEFAULT_PORTS = {"http": 80, "https": 443}
UNREADABLE = "(a URL that does not parse, not shown)"


def shown_url(url: str) -> str:
    """``url`` for a line: ``scheme://host:port/path``, no user info, query or fragment,
    control characters escaped, cut, masked; a URL that does not parse is not shown."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:  # a port that is no number, a broken IPv6 literal
        return UNREADABLE
    if not parts.scheme or not host:
        return UNREADABLE
    if ":" in host:
        host = f"[{host}]"
    return mask(escape(clip(f"{parts.scheme}://{host}{port}{parts.path}", SHOWN_URL_CHARS)))


def origin(url: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of ``url``, the port filled in from the scheme; None when it
    has none of them or does not parse."""
    try:
        parts: SplitResult = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return scheme, parts.hostname.lower(), port if port is not None else DEFAULT_PORTS[scheme]


def resolved(current: str, location: str) -> str:
    """``location`` (absolute, or relative to ``current``) as an absolute URL; '' when it
    cannot be read as one."""
    try:
        return urljoin(current, location.strip())
    except ValueError:  # a broken IPv6 literal in it
        return ""


@dataclass(frozen=True)
class Redirect:
    """Where a redirect may be followed to: the absolute URL of the next request."""

    url: str


def next_hop(
    status: int, headers: Mapping[str, str], current: str, *, home: str, where: str
) -> Redirect | BrokerUnavailable:
    """The request that follows a 3xx answer to ``current``: a :class:`Redirect` when it
    keeps the method, the body and the origin of ``home`` (the configured URL), otherwise
    the fault that holds the message, naming the target."""
    said = f"{where} answered {status}"
    location = headers.get("Location", "")
    if not location:
        return BrokerUnavailable(f"{said} without a Location to follow: set --url to where the destination is")
    target = resolved(current, location)
    shown = shown_url(target)
    if status not in FOLLOWED_STATUSES:
        return BrokerUnavailable(
            f"{said}, a redirect to {shown} that does not keep the method and body (only 307 and 308 are"
            " followed): set --url to it"
        )
    if not target or origin(target) is None or origin(target) != origin(home):
        return BrokerUnavailable(
            f"{said}, a redirect to another origin, {shown}: the body and the static headers go to"
            " --url's origin only; set --url to it if it is the destination"
        )
    return Redirect(target)


def unfollowed(status: int, headers: Mapping[str, str], current: str, *, where: str) -> BrokerUnavailable:
    """A 3xx answer without ``--http-follow-redirects``: the URL is not where the
    destination is."""
    location = headers.get("Location", "")
    if not location:
        return BrokerUnavailable(f"{where} answered {status} without a Location: --url is not where the destination is")
    target = shown_url(resolved(current, location))
    return BrokerUnavailable(
        f"{where} answered {status}, a redirect to {target}: set --url to it, or --http-follow-redirects"
    )


def too_many(last: str, *, where: str) -> BrokerUnavailable:
    """The fault of a message that was redirected more than :data:`MAX_REDIRECTS` times."""
    return BrokerUnavailable(
        f"{where}: more than {MAX_REDIRECTS} redirects in a row, the last to {shown_url(last)}: set --url to"
        " where the destination is"
    )
