"""Which names the console answers to: the ``Host`` check against DNS rebinding.

A page on another site can make its own name resolve to 127.0.0.1 after it loaded (DNS
rebinding); its scripts then read the console as their own origin, and no cookie or
token protects the read-only pages. The browser still sends that site's name in
``Host``, so the console answers only to the names it is known by: loopback names
always, the address it is bound to, and those given with ``--allow-host`` (the name a
proxy forwards, say). Bound to a wildcard address with no ``--allow-host``, it cannot
know its names and answers to any (the start-up warning says so).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from relay.errors import ConfigError, shown

WILDCARDS = frozenset({"", "0.0.0.0", "::"})
HOST_MAX = 253  # characters of a DNS name


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(bind: str, extra: tuple[str, ...]) -> frozenset[str] | None:
    """The names beyond loopback ones that a console bound to ``bind`` answers to, with
    ``extra`` from ``--allow-host``; None: any (a wildcard bind, no ``--allow-host``)."""
    names = {check_host_name(h) for h in extra}
    if bind in WILDCARDS:
        return frozenset(names) if names else None
    if not is_loopback(bind):
        names.add(bind.lower())
    return frozenset(names)


def check_host_name(name: str) -> str:
    """``name`` as ``--allow-host`` takes it (a host name or address, no port), lowercased."""
    text = name.strip().lower()
    if _is_ipv6(text):
        return text
    if not text or len(text) > HOST_MAX or any(c.isspace() or c in "/:@?#[]" or not c.isprintable() for c in text):
        raise ConfigError(f"invalid --allow-host {shown(name)}: a host name or address, without a port")
    return text


def host_of(header: str) -> str:
    """The host name in a ``Host`` header (``name:port``, ``[v6]:port``), lowercased; ''
    when it cannot be read."""
    try:
        return (urlsplit("//" + header).hostname or "").lower()
    except ValueError:
        return ""


def answers_to(header: str, allowed: frozenset[str] | None) -> bool:
    if allowed is None:
        return True
    host = host_of(header)
    return bool(host) and (is_loopback(host) or host in allowed)


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False
