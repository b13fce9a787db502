"""The event-type ordering map: which event types are delivered in order per aggregate.

Rules, from strongest to weakest:

1. an exact name in ``ordered`` or ``unordered``;
2. a glob pattern (``*`` for any run of characters, ``?`` for one; every other character,
   ``[`` included, stands for itself) in ``ordered`` or ``unordered``; when a
   type matches patterns of both lists, ``ordered`` wins, because silently giving up
   order is the worse mistake. Globs are matched in linear time (:mod:`relay.globs`);
   in the database, by PostgreSQL's regex engine, which does not backtrack on them;
3. ``default``.

A name may not stand in both lists, and a list entry may not be empty.

Ordering scope: within one ``aggregate_id``, the ordered messages form one sequence in
id order, whatever their event types. Unordered messages of the same aggregate are
outside that sequence: they neither wait for ordered ones nor hold them up (so a dead
notification never blocks the order's events).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relay.errors import ConfigError
from relay.globs import compile_glob
from relay.globs import is_glob as _is_glob

DEFAULTS = ("ordered", "unordered")
# Event types whose class is remembered, and the longest one remembered: at most about
# 10 MB held, whatever the producers write (a new type per message, 2 MB types); a type
# not remembered costs one linear match again.
MAX_REMEMBERED = 10_000
MAX_REMEMBERED_CHARS = 1_000


@dataclass(frozen=True)
class OrderingMap:
    """Routes each event type to the ordered or the unordered claim strategy."""

    default_ordered: bool = True
    ordered: tuple[str, ...] = ()
    unordered: tuple[str, ...] = ()
    _cache: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for entry in (*self.ordered, *self.unordered):
            if not isinstance(entry, str) or not entry.strip():
                raise ConfigError(f"invalid ordering entry {entry!r}: expected a non-empty event type or glob")
        both = {e for e in self.ordered if not _is_glob(e)} & {e for e in self.unordered if not _is_glob(e)}
        if both:
            raise ConfigError(f"event type {sorted(both)[0]!r} is listed as both ordered and unordered")

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> OrderingMap:
        """Build the map from the ``[ordering]`` table of the config file."""
        unknown = set(section) - {"default", "ordered", "unordered"}
        if unknown:
            raise ConfigError(f"unknown key in [ordering]: {sorted(unknown)[0]!r}")
        default = section.get("default", "ordered")
        if default not in DEFAULTS:
            raise ConfigError(f"invalid ordering default {default!r}: expected 'ordered' or 'unordered'")
        return cls(
            default_ordered=default == "ordered",
            ordered=_entries(section.get("ordered", ()), "ordering.ordered"),
            unordered=_entries(section.get("unordered", ()), "ordering.unordered"),
        )

    @classmethod
    def from_sql_params(cls, params: Mapping[str, Any]) -> OrderingMap:
        """The inverse of :meth:`sql_params`, for a map read back from the database."""
        return cls(
            default_ordered=bool(params["ord_default"]),
            ordered=(*params["ord_names"], *(_from_regex(p) for p in params["ord_patterns"])),
            unordered=(*params["unord_names"], *(_from_regex(p) for p in params["unord_patterns"])),
        )

    def is_ordered(self, event_type: str) -> bool:
        """Whether ``event_type`` is delivered in order per aggregate under this map."""
        cached = self._cache.get(event_type)
        if cached is None:
            cached = self._classify(event_type)
            if len(event_type) <= MAX_REMEMBERED_CHARS:
                if len(self._cache) >= MAX_REMEMBERED:
                    self._cache.clear()
                self._cache[event_type] = cached
        return cached

    def _classify(self, event_type: str) -> bool:
        if event_type in self.exact_ordered:
            return True
        if event_type in self.exact_unordered:
            return False
        if any(compile_glob(e).matches(event_type) for e in self.ordered if _is_glob(e)):
            return True
        if any(compile_glob(e).matches(event_type) for e in self.unordered if _is_glob(e)):
            return False
        return self.default_ordered

    @property
    def exact_ordered(self) -> list[str]:
        return [e for e in self.ordered if not _is_glob(e)]

    @property
    def exact_unordered(self) -> list[str]:
        return [e for e in self.unordered if not _is_glob(e)]

    @property
    def regex_ordered(self) -> list[str]:
        return [_to_regex(e) for e in self.ordered if _is_glob(e)]

    @property
    def regex_unordered(self) -> list[str]:
        return [_to_regex(e) for e in self.unordered if _is_glob(e)]

    def sql_params(self) -> dict[str, Any]:
        """Parameters for the database-side twin of :meth:`is_ordered` (``is_ordered`` in SQL)."""
        return {
            "ord_names": self.exact_ordered,
            "unord_names": self.exact_unordered,
            "ord_patterns": self.regex_ordered,
            "unord_patterns": self.regex_unordered,
            "ord_default": self.default_ordered,
        }

    def describe(self) -> str:
        default = "ordered" if self.default_ordered else "unordered"
        return f"default={default} ordered={list(self.ordered)} unordered={list(self.unordered)}"


def names_and_patterns(entries: Iterable[str]) -> tuple[list[str], list[str]]:
    """``entries`` (names or globs) as the SQL filters take them: the exact names, and the
    globs as regexes for PostgreSQL's ``~`` (``relay replay --event-type``)."""
    entries = list(entries)
    return [e for e in entries if not _is_glob(e)], [_to_regex(e) for e in entries if _is_glob(e)]


def _entries(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in (s.strip() for s in value.split(",")) if v]
    if not isinstance(value, Iterable) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"invalid {name}: expected a list of event types or glob patterns")
    return tuple(value)


def _to_regex(glob: str) -> str:
    """A glob as an anchored regex that Python's ``re`` and PostgreSQL's ``~`` read alike.

    Only ``*`` and ``?`` are special; everything else is escaped. ``re.escape`` puts a
    backslash only before non-alphanumeric characters, which both engines take literally.
    Python matches globs with :mod:`relay.globs`, never this regex: Python's ``re``
    backtracks on it (quadratic and worse). PostgreSQL's engine runs it as an automaton,
    linear in the event type (BENCHMARKS.md, "Globs").
    """
    body = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in glob)
    return f"^{body}$"


def _from_regex(regex: str) -> str:
    """The glob :func:`_to_regex` made ``regex`` from."""
    body = regex[1:-1]
    out, i = [], 0
    while i < len(body):
        if body.startswith(".*", i):
            out.append("*")
            i += 2
        elif body[i] == ".":
            out.append("?")
            i += 1
        elif body[i] == "\\":
            out.append(body[i + 1])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)
