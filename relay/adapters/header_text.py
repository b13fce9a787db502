"""Header values for wires whose headers are lines of text (HTTP, NATS): printable ASCII
goes as it is; anything else (an aggregate id in Greek, a control character that would end
the line, '%' itself) is percent-encoded UTF-8, which a receiver undoes with any URL
unquote."""

from __future__ import annotations

import re
from urllib.parse import quote

_SAFE = "".join(chr(c) for c in range(32, 127) if chr(c) != "%")
_PLAIN = re.compile(r"[\x20-\x24\x26-\x7e]*")


def header_value(value: object) -> str:
    text = str(value)
    # Almost every value needs no escape: the match is cheaper than quote()'s walk.
    return text if _PLAIN.fullmatch(text) else quote(text, safe=_SAFE)
