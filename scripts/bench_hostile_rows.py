"""Poison rows in a large backlog: does every other row still go, and at what cost?

    .venv/bin/python scripts/bench_hostile_rows.py                    # 1,000,000 rows, 1 in 1,000 poisoned
    .venv/bin/python scripts/bench_hostile_rows.py --rows 100000      # a smoke run

Two runs, each over a fresh outbox in a schema of its own: the same backlog (ordered
events over 2,000 aggregates, written in one statement), once clean and once with every
``--every``-th row carrying ``headers`` nested 5,000 arrays deep on an aggregate of its
own (what stopped every relay that claimed one before issue 38). One `relay start
--broker log --workers 4` process drains each (its output to /dev/null); the clock runs
from its start to the last row settled. Printed: rows done and dead, whether the relay was
still running at the end, and both rates with their ratio (one run each, same machine).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
RELAY = str(Path(sys.executable).with_name("relay"))
DEPTH = 5000


def run(dsn: str, rows: int, every: int | None) -> dict[str, object]:
    schema = f"bench_hostile_{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    migrated = subprocess.run(
        [RELAY, "migrate", "--dsn", dsn, "--schema", schema, "--ordered", "Order*"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if migrated.returncode != 0:
        raise SystemExit(f"relay migrate failed: {migrated.stderr.strip()}")
    table = sql.Identifier(schema, "outbox")
    poison = "[" * DEPTH + "]" * DEPTH
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            started = time.monotonic()
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, headers)"
                    " SELECT 'order',"
                    "        CASE WHEN %(every)s::int > 0 AND i %% %(every)s::int = 0 THEN 'poison-' || i"
                    "             ELSE 'agg-' || (i %% 2000) END,"
                    "        'OrderPlaced', jsonb_build_object('n', i),"
                    "        CASE WHEN %(every)s::int > 0 AND i %% %(every)s::int = 0 THEN %(poison)s::jsonb END"
                    "   FROM generate_series(1, %(rows)s) AS i"
                ).format(table),
                {"rows": rows, "every": every or 0, "poison": poison},
            )
            print(f"  wrote {rows:,} rows in {time.monotonic() - started:.1f}s", flush=True)
            # Its log to a file: a pipe nobody reads would fill with the dead rows' lines and
            # block the relay's next log write.
            with tempfile.TemporaryFile("w+") as log:
                relay = subprocess.Popen(
                    [RELAY, "start", "--dsn", dsn, "--schema", schema, "--broker", "log", "--workers", "4"],
                    stdout=subprocess.DEVNULL, stderr=log, text=True, env=env,
                )  # fmt: skip
                started = time.monotonic()
                settled = 0
                while settled < rows and relay.poll() is None:
                    time.sleep(0.5)
                    row = conn.execute(
                        sql.SQL("SELECT count(*) FILTER (WHERE status IN ('done', 'dead')) FROM {}").format(table)
                    ).fetchone()
                    settled = int(row[0]) if row else 0
                seconds = time.monotonic() - started
                alive = relay.poll() is None
                relay.terminate()
                relay.wait(timeout=60)
                log.seek(0)
                stderr = log.read()
            counts = dict(conn.execute(sql.SQL("SELECT status, count(*) FROM {} GROUP BY 1").format(table)).fetchall())
            reasons = conn.execute(
                sql.SQL("SELECT DISTINCT left(last_error, 120) FROM {} WHERE status = 'dead'").format(table)
            ).fetchall()
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return {
        "seconds": seconds,
        "rate": rows / seconds,
        "counts": counts,
        "alive": alive,
        "reasons": [r for (r,) in reasons],
        "stderr_tail": stderr.strip().splitlines()[-3:] if not alive else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=os.environ.get("RELAY_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=1000, help="one poisoned row in this many")
    args = parser.parse_args()
    results = {}
    for label, every in (("clean", None), ("poisoned", args.every)):
        print(f"{label}: {args.rows:,} rows" + (f", 1 in {every:,} poisoned" if every else ""), flush=True)
        result = run(args.dsn, args.rows, every)
        results[label] = result
        print(
            f"  {result['counts']} in {result['seconds']:.1f}s ({result['rate']:,.0f} rows/s);"
            f" relay still running at the end: {result['alive']}",
            flush=True,
        )
        for reason in result["reasons"]:
            print(f"  dead: {reason}")
        for line in result["stderr_tail"]:
            print(f"  relay: {line}")
    ratio = float(results["poisoned"]["rate"]) / float(results["clean"]["rate"])  # type: ignore[arg-type]
    print(f"poisoned / clean: {ratio:.2f}x (one run each)")


if __name__ == "__main__":
    main()
