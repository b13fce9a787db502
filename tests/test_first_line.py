"""relay.errors.first_line: the one rule for quoting someone else's error in one line."""

from __future__ import annotations

import pytest

from relay.errors import first_line


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ValueError("boom"), "boom"),
        (ValueError("\n  first  \nsecond"), "first"),
        (ValueError(""), "ValueError"),  # no message: the type says what happened
        (ValueError("  \n \n"), "ValueError"),
        ("relation missing\nDETAIL: x", "relation missing"),
        ("", ""),
        ("\n\n", ""),
    ],
)
def test_first_line_takes_the_first_non_empty_line(error: BaseException | str, expected: str) -> None:
    assert first_line(error) == expected
