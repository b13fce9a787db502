"""Glob matching against hostile event types: relay.globs, the regex it replaced, and
PostgreSQL's regex engine (which evaluates the same globs in ``<table>_is_ordered`` and
``relay replay --event-type``).

    .venv/bin/python scripts/bench_globs.py                    # 500 KB and 2 MB event types
    .venv/bin/python scripts/bench_globs.py --reference-timeout 0   # skip the old regex

Each case is one glob against one event type built to hurt a backtracking matcher. The
old regex (``re.fullmatch`` of the glob as ``^.*Order.*Created$``) runs in a child process
killed after ``--reference-timeout`` seconds, shown as "> N s". One run, wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from relay.globs import glob_matches
from relay.ordering import _to_regex

KB = 1024


def cases(size: int) -> list[tuple[str, str, Callable[[int], str]]]:
    """(name, glob, event type of ``size`` characters built by a function of the size)."""
    rng = random.Random(1)
    return [
        ("issue 25: *Order*Created", "*Order*Created", lambda n: "Order" * (n // 5)),
        ("*a*a*a*a*b against a...", "*a*a*a*a*b", lambda n: "a" * n),
        ("1000 ? * 1000 ?", "?" * 1000 + "*" + "?" * 1000, lambda n: "x" * n),
        ("*a + 20 ? + b* against a...", "*a" + "?" * 20 + "b*", lambda n: "a" * n),
        ("*a + 200 ? + c* against random ab", "*a" + "?" * 200 + "c*", lambda n: "".join(rng.choices("ab", k=n))),
    ]


def timed(call: Callable[..., object], *args: object) -> tuple[object, float]:
    started = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - started


def in_postgresql(conn: psycopg.Connection[tuple[object, ...]], glob: str, text: str) -> object:
    """The glob as the database reads it (the regex of relay.ordering, through ``~``)."""
    return conn.execute("SELECT %s::text ~ %s", (text, _to_regex(glob))).fetchone()


def reference(glob: str, size: int, builder_index: int, timeout: float) -> str:
    """The old matcher in a child process, so a run that never ends can be cut off."""
    if timeout <= 0:
        return "-"
    code = (
        "import re, sys, time; sys.path.insert(0, sys.argv[1]);"
        "from scripts.bench_globs import cases; from relay.ordering import _to_regex;"
        "name, glob, build = cases(int(sys.argv[2]))[int(sys.argv[3])]; text = build(int(sys.argv[2]));"
        "t = time.perf_counter(); re.fullmatch(_to_regex(glob), text, re.DOTALL);"
        "print(f'{time.perf_counter() - t:.2f} s')"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(ROOT), str(size), str(builder_index)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
    except subprocess.TimeoutExpired:
        return f"> {timeout:g} s"
    return done.stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--dsn", default=os.environ.get("RELAY_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[500, 2048])
    p.add_argument("--reference-timeout", type=float, default=60, help="seconds; 0 skips the old regex")
    args = p.parse_args()
    print(f"{'case':36} {'size':>8} {'relay.globs':>12} {'PostgreSQL ~':>13} {'old regex':>10}")
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        for size_kb in args.sizes_kb:
            size = size_kb * KB
            for i, (name, glob, build) in enumerate(cases(size)):
                text = build(size)
                matched, ours = timed(glob_matches, glob, text)
                row, pg = timed(in_postgresql, conn, glob, text)
                assert row == (matched,), (name, row, matched)
                old = reference(glob, size, i, args.reference_timeout)
                print(f"{name:36} {size_kb:>5} KB {ours * 1000:>9.1f} ms {pg * 1000:>10.1f} ms {old:>10}", flush=True)


if __name__ == "__main__":
    main()
