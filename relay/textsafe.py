"""Producer data made safe to print in text: control characters escaped, long values cut.

Event types, aggregate ids and error texts come from producers and brokers, not from the
relay. Printed raw, an escape sequence repaints an operator's terminal and a newline in an
aggregate id forges a whole log line; a 70,000-character event type turns one log line or
one table row into a wall. Every text renderer (the text log format, `relay status`,
`relay dead`, `relay explain`) passes such values through :func:`printable`. JSON output
needs none of this: ``json.dumps`` escapes control characters itself.
"""

from __future__ import annotations

# Characters that move the cursor, end a line or change how a terminal or log viewer shows
# what follows: C0 controls and DEL, C1 controls (U+0085 NEXT LINE among them), the Unicode
# line and paragraph separators (str.splitlines and some viewers break lines at them), and
# the bidirectional overrides and isolates (they make text read differently from how it is
# stored).
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
_CONTROL = (
    *range(0x00, 0x20),
    0x7F,
    *range(0x80, 0xA0),
    0x061C,
    0x200E,
    0x200F,
    0x2028,
    0x2029,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
)
_ESCAPES: dict[int, str] = {
    code: _NAMED.get(chr(code), f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}") for code in _CONTROL
}

# How much of one producer-controlled value a table cell shows. Ids and event types are
# far shorter in practice; the JSON output (--json) always carries the whole value.
CELL_CHARS = 200


def escape(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\x1b``,
    ``\\n``, ``\\u2028``); everything else, backslashes included, unchanged. Linear."""
    return text.translate(_ESCAPES)


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a marker saying how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


def printable(value: object, limit: int = CELL_CHARS) -> str:
    """``value`` as text fit for one cell or field of a line: cut, then escaped (cutting
    first bounds the work and the output: an escape is at most six characters)."""
    return escape(clip(str(value), limit))
