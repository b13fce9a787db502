"""Standard Webhooks signatures (https://www.standardwebhooks.com): what a receiver checks
with any of its libraries.

The signed content is ``{webhook-id}.{webhook-timestamp}.{body}``; the signature is the
base64 HMAC-SHA256 of it under the secret's key, sent as ``v1,<signature>``, one per
secret, space-separated, so that a receiver holding either the old or the new secret
verifies a request while the secret rotates.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from relay.dsn import register_secret
from relay.errors import ConfigError

PREFIX = "whsec_"


def parse_secrets(text: str, where: str) -> tuple[bytes, ...]:
    """The keys of the whitespace-separated ``whsec_<base64>`` secrets in ``text`` (a
    secret without the prefix is taken as the base64 key itself). Each is registered with
    the log mask; a malformed one is a ConfigError that does not repeat it."""
    keys: list[bytes] = []
    for number, secret in enumerate(text.split(), 1):
        register_secret(secret)
        encoded = secret[len(PREFIX) :] if secret.startswith(PREFIX) else secret
        try:
            key = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"{where}: secret {number} is not whsec_ followed by base64") from None
        if len(key) < 16:
            raise ConfigError(f"{where}: secret {number} is {len(key)} bytes; a signing key needs at least 16")
        register_secret(encoded)
        keys.append(key)
    return tuple(keys)


def signature(keys: tuple[bytes, ...], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value for one request."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join("v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode() for key in keys)
