"""Event-type globs (relay.globs): the same answers as the regex the ordering map has always
given PostgreSQL, and linear time against a producer's 2 MB event type (issue 25, finding 7:
``*Order*Created`` against a 500 KB event type held the relay's event loop for seconds)."""

from __future__ import annotations

import functools
import itertools
import re
import time
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.globs import glob_matches
from relay.ordering import OrderingMap, _to_regex, names_and_patterns
from relay.routes import Route, Router
from tests.conftest import Db

# The characters that make globs and event types interesting: two letters, drawn most
# often, so that segments repeat, overlap and nearly fit; '?'; a newline ('?' and '*' take
# it); regex metacharacters that must stay literal; a character outside ASCII.
_CHARS = "aaaabbbb??\n.[]\\^$+(é"
_SEGMENTS = st.text(alphabet=_CHARS, max_size=4)
# A glob: up to 4 segments between '*' (so often 2 or 3 '*', even side by side).
_GLOBS = st.lists(_SEGMENTS, min_size=1, max_size=4).map("*".join)
_TEXTS = st.text(alphabet=_CHARS + "*", max_size=14)  # event types may hold "*" and "?" too
_FILLS = st.text(alphabet="ab", max_size=3)  # what a '*' stands for: short, so segments nearly meet


def reference(glob: str, event_type: str) -> bool:
    """The matcher before relay.globs: the glob as a regex, run by Python's backtracking
    ``re`` (correct, but slow on long event types). Exact names compare as strings."""
    if "*" not in glob and "?" not in glob:
        return glob == event_type
    return _regex(glob).fullmatch(event_type) is not None


@functools.lru_cache(maxsize=4096)
def _regex(glob: str) -> re.Pattern[str]:
    return re.compile(_to_regex(glob), re.DOTALL)


@st.composite
def glob_and_instance(draw: st.DrawFn) -> tuple[str, str]:
    """A glob and an event type built from it (each '*' some text, each '?' one character),
    matching, or edited once (a character dropped, added or changed; an end cut off) so it
    barely does not: where a wrong matcher parts from the right one."""
    glob = draw(_GLOBS)
    text = "".join(draw(_FILLS) if c == "*" else draw(st.sampled_from(_CHARS)) if c == "?" else c for c in glob)
    edit = draw(st.sampled_from(["none", "drop", "add", "change", "cut_head", "cut_tail"]))
    i = draw(st.integers(0, len(text)))
    c = draw(st.sampled_from("ab\n"))
    if edit == "drop":
        text = text[:i] + text[i + 1 :]
    elif edit == "add":
        text = text[:i] + c + text[i:]
    elif edit == "change":
        text = text[:i] + c + text[i + 1 :]
    elif edit == "cut_head":
        text = text[i:]
    elif edit == "cut_tail":
        text = text[:i]
    return glob, text


def test_every_small_glob_matches_as_the_regex_did() -> None:
    """Every glob of up to 5 characters over 'a', 'b', '?' and '*', against every event type
    of up to 6 letters: 173,355 pairs, where segments overlap, repeat and barely fit."""
    globs = ["".join(p) for n in range(6) for p in itertools.product("ab?*", repeat=n)]
    texts = ["".join(p) for n in range(7) for p in itertools.product("ab", repeat=n)]
    wrong = [(g, t) for g in globs for t in texts if glob_matches(g, t) != reference(g, t)]
    assert wrong == [], wrong[:10]


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.tuples(_GLOBS, _TEXTS), glob_and_instance()))
def test_glob_matches_as_the_regex_did(case: tuple[str, str]) -> None:
    glob, event_type = case
    assert glob_matches(glob, event_type) == reference(glob, event_type), case


def test_glob_examples() -> None:
    assert glob_matches("*", "") and glob_matches("*", "anything\n")
    assert glob_matches("Order*", "Order") and not glob_matches("Order*", "Orde")
    assert glob_matches("*Order*Created", "OrderCreated") and not glob_matches("*Order*Created", "OrdeCreated")
    assert glob_matches("a*a", "aa") and not glob_matches("a*a", "a")  # the ends never overlap
    assert glob_matches("??", "é\n") and not glob_matches("??", "abc")
    assert glob_matches("[a]*", "[a]x") and not glob_matches("[a]*", "ax")  # '[' is literal
    assert glob_matches("*a?c*", "xxabcabc") and not glob_matches("*a?c*", "acxac")
    assert not glob_matches("order*", "OrderCreated")  # case counts


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.tuples(_GLOBS, _TEXTS), glob_and_instance()), min_size=1, max_size=20))
def test_glob_matches_as_postgresql_does(db: Db, cases: list[tuple[str, str]]) -> None:
    """The database reads the same globs (`<table>_is_ordered`, `relay replay --event-type`)
    through ``~`` and the regex of :func:`names_and_patterns`: one answer on both sides.
    (PostgreSQL's text holds no NUL, which the alphabet leaves out.)"""
    globs = [g for g, _ in cases if "*" in g or "?" in g]
    if not globs:
        return
    _, patterns = names_and_patterns(globs)
    texts = [t for _, t in cases]
    rows = db.conn.execute(
        "SELECT t.i, p.j, t.text ~ p.pattern"
        "  FROM unnest(%s::text[]) WITH ORDINALITY AS t(text, i),"
        "       unnest(%s::text[]) WITH ORDINALITY AS p(pattern, j)",
        (texts, patterns),
    ).fetchall()
    for i, j, matched in rows:
        assert glob_matches(globs[j - 1], texts[i - 1]) == matched, (globs[j - 1], texts[i - 1])


# ---- hostile sizes

MB2 = 2 * 1024 * 1024
# Globs that make a backtracking matcher quadratic or worse on the event types beside
# them (each pair: a glob and an event type of 2 MB built to hurt it), with the answer.
HOSTILE: list[tuple[str, str, bool]] = [
    ("*Order*Created", "Order" * (MB2 // 5), False),  # the case: 14 s at 500 KB before
    ("*Order*Created", "Order" * (MB2 // 5) + "Created", True),
    ("*a*a*a*a*b", "a" * MB2, False),  # never finished before
    ("*a*a*a*a*b", "a" * MB2 + "b", True),
    ("?" * 1000 + "*" + "?" * 1000, "x" * MB2, True),
    ("*a" + "?" * 20 + "b*", "a" * MB2, False),
    ("*" + "a" * 100 + "b*", "a" * MB2, False),
]
# A generous bound: each takes under 50 ms on this machine (BENCHMARKS.md, "Globs").
BOUND_S = 1.0


def _timed(call: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - started


@pytest.mark.parametrize(("glob", "event_type", "expected"), HOSTILE, ids=[f"{g[:16]}-{len(t)}" for g, t, _ in HOSTILE])
def test_a_2mb_event_type_is_matched_in_bounded_time(glob: str, event_type: str, expected: bool) -> None:
    route = Route(match=(glob,), broker="sqs", settings={"queue_url": "q"})
    chosen, took_route = _timed(Router((route,), has_default=True).route_of, event_type)
    assert chosen == (0 if expected else -1)
    ordered, took_map = _timed(OrderingMap(default_ordered=False, ordered=(glob,)).is_ordered, event_type)
    assert ordered is expected
    assert took_route < BOUND_S and took_map < BOUND_S, (took_route, took_map)


def test_postgresql_matches_a_2mb_event_type_in_bounded_time(db: Db) -> None:
    """The database side of the same map: `<table>_is_ordered`, which every producer's insert
    runs, answers as Python does, and PostgreSQL's regex engine does not backtrack on these."""
    function = psycopg.sql.Identifier(db.names.schema, f"{db.names.table}_is_ordered")
    query = psycopg.sql.SQL(
        "SELECT {}(%(e)s, %(ord_names)s, %(unord_names)s, %(ord_patterns)s, %(unord_patterns)s, %(ord_default)s)"
    ).format(function)
    for glob, event_type, expected in HOSTILE:
        m = OrderingMap(default_ordered=False, ordered=(glob,))
        row, took = _timed(lambda e, m=m: db.conn.execute(query, {"e": e, **m.sql_params()}).fetchone(), event_type)
        assert row == (expected,), glob
        assert took < BOUND_S, (glob, took)
