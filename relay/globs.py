"""Event-type globs (``*`` any run of characters, ``?`` one character, everything else
literal), matched in time linear in the event type's length.

The ``[ordering]`` lists, ``--route`` and ``relay replay --event-type`` all read their
entries this way. A glob was once matched as the regex ``^.*Order.*Created$`` by Python's
backtracking ``re``: quadratic for ``*Order*Created`` against an event type that repeats
``Order`` (14 s at 500 KB, on the event loop), and worse for every ``*`` added
(``*a*a*a*a*b`` against ``aaaa...``). A producer chooses the event type, so its length is
the attacker's; the glob is the operator's, short.

The matcher cuts the glob at its ``*`` into segments. Each segment has a fixed length (a
``?`` is one character), so the first must sit at the start of the event type, the last
at its end, and each one between can take the leftmost place that fits after the one
before it: a later place never leaves more room for the segments that follow. Finding a
segment is ``str.find`` for a literal one, and for one with ``?`` a search of a regex made
of literals and ``.{n}``, fixed-length, with nothing to backtrack over: at most (event type
length x segment length) steps, the bound PostgreSQL's own matcher has for these globs
(sql: ``<table>_is_ordered``, replay's ``~ ANY``), measured in BENCHMARKS.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

GLOB_CHARS = frozenset("*?")
# A segment in runs: of '?', and of anything else.
_RUNS = re.compile(r"\?+|[^?]+", re.DOTALL)


def is_glob(entry: str) -> bool:
    """Whether ``entry`` is a glob (holds ``*`` or ``?``) rather than an exact name."""
    return any(c in GLOB_CHARS for c in entry)


@dataclass(frozen=True)
class _Segment:
    """A run of a glob between two ``*``: literal characters and ``?``, of fixed length."""

    text: str
    # For a segment holding '?': the regex that finds it (literals, '.' and '.{n}': fixed
    # length, no choice to backtrack over); None for a literal segment, found by str.find.
    regex: re.Pattern[str] | None

    @classmethod
    def of(cls, text: str) -> _Segment:
        if "?" not in text:
            return cls(text, None)
        # A run of '?' as one counted repeat: re steps over '.{200}' (any character, with
        # DOTALL) in one move where 200 '.' cost 200 steps (a 2 MB search: 0.03 s against 0.27 s).
        body = "".join(
            re.escape(run) if run[0] != "?" else "." if len(run) == 1 else f".{{{len(run)}}}"
            for run in _RUNS.findall(text)
        )
        return cls(text, re.compile(body, re.DOTALL))

    def at(self, subject: str, pos: int) -> bool:
        """Whether the segment matches ``subject`` at ``pos`` exactly."""
        if self.regex is None:
            return subject.startswith(self.text, pos)
        return self.regex.match(subject, pos, pos + len(self.text)) is not None

    def find(self, subject: str, start: int, end: int) -> int:
        """The leftmost place in ``subject[start:end]`` where the segment fits whole, or -1."""
        if self.regex is None:
            return subject.find(self.text, start, end)
        found = self.regex.search(subject, start, end)
        return -1 if found is None else found.start()


@dataclass(frozen=True)
class Glob:
    """A compiled glob; :meth:`matches` says whether a whole event type fits it."""

    pattern: str
    segments: tuple[_Segment, ...]  # the pattern cut at each '*': len == count('*') + 1
    fixed: int  # the characters a subject needs at least: every one but the '*'

    @classmethod
    def of(cls, pattern: str) -> Glob:
        segments = tuple(_Segment.of(part) for part in pattern.split("*"))
        return cls(pattern, segments, sum(len(s.text) for s in segments))

    def matches(self, subject: str) -> bool:
        """Whether all of ``subject`` fits the glob (as ``fnmatch`` would with only ``*`` and
        ``?``, every other character literal, case-sensitive; ``?`` and ``*`` take newlines)."""
        first = self.segments[0]
        if len(self.segments) == 1:  # no '*': the one segment is the whole subject
            return len(subject) == len(first.text) and first.at(subject, 0)
        last, middle = self.segments[-1], self.segments[1:-1]
        if len(subject) < self.fixed:  # the first and last segments would overlap
            return False
        end = len(subject) - len(last.text)
        if not (first.at(subject, 0) and last.at(subject, end)):
            return False
        pos = len(first.text)
        for segment in middle:
            found = segment.find(subject, pos, end)
            if found < 0:
                return False
            pos = found + len(segment.text)
        return True


# Globs compiled once each: the operator's configuration holds a handful.
_COMPILED_MAX = 1024


@lru_cache(maxsize=_COMPILED_MAX)
def compile_glob(pattern: str) -> Glob:
    """``pattern`` compiled, remembered for the next call."""
    return Glob.of(pattern)


def glob_matches(entry: str, event_type: str) -> bool:
    """Whether ``event_type`` is the name ``entry``, or fits it when ``entry`` is a glob."""
    if not is_glob(entry):
        return entry == event_type
    return compile_glob(entry).matches(event_type)
