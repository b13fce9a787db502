"""What the relay costs the producers' own transactions: insert rate into the design
reference's plain outbox table beside a `relay migrate`d one, same run, same machine.

The relay's triggers (routing at insert, the commit stamp at COMMIT, the wake-up check)
and its indexes run inside every producer transaction, so they are part of what users
pay. Each producer is a pgbench client inserting single-row transactions (autocommit)
into a fresh table; variants and producer counts alternate within every round, and the
median of the rounds is printed.

Producers send a wake-up (NOTIFY) only while every relay is idle (migration 0007), so
the relay schema is measured in three states: a relay working (its row in
``<table>_listeners`` says so: what producers pay under load), a relay idle (every insert
notifies: what they pay while nothing else happens), and wake-ups off for the whole
outbox (``relay settings set --no-notify``). The rows are written here as a relay would
write them, valid for an hour; no relay runs.

    .venv/bin/python scripts/bench_producer.py               # about 3 minutes
    .venv/bin/python scripts/bench_producer.py --quick       # a smoke run
    .venv/bin/python scripts/bench_producer.py --markdown    # the table for BENCHMARKS.md

Needs `pgbench` (Debian: package postgresql-client or the server package).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.migrate import migrate
from relay.sqlnames import OutboxNames
from scripts.reference_schema import REFERENCE_DDL

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_producer"


# One event per transaction, 1,000 aggregates, a payload of about 100 bytes.
INSERT_SCRIPT = """\\set a random(1, 1000)
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', 'order-' || :a, 'OrderPaid',
        '{{"order_id": 42, "amount": "19.90", "currency": "EUR", "note": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}');
"""

PLAIN = "plain table"
WORKING = "relay schema, wake-ups on, a relay working"
IDLE = "relay schema, wake-ups on, a relay idle"
OFF = "relay schema, `--no-notify`"
VARIANTS = (PLAIN, WORKING, IDLE, OFF)


def setup(dsn: str, variant: str) -> str:
    """A fresh table for ``variant``; returns its qualified name for the pgbench script."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        table = sql.Identifier(SCHEMA, "outbox")
        if variant == PLAIN:
            conn.execute(sql.SQL(REFERENCE_DDL).format(t=table))
        else:

            async def relay_schema() -> None:
                async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
                    await migrate(aconn, OutboxNames(SCHEMA))

            asyncio.run(relay_schema())
            # The default map (every type ordered), as a relay that never stored one leaves it.
            conn.execute(
                sql.SQL("UPDATE {} SET notify = %s").format(sql.Identifier(SCHEMA, "outbox_settings")),
                (variant != OFF,),
            )
            # One relay process, as its row in <table>_listeners describes it (relay.wakeup);
            # with wake-ups off no relay LISTENs, so none has a row.
            if variant != OFF:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (owner, idle, expires_at) VALUES ('bench:1', %s, now() + interval '1 hour')"
                    ).format(sql.Identifier(SCHEMA, "outbox_listeners")),
                    (variant == IDLE,),
                )
        conn.execute("CHECKPOINT")
    return f"{SCHEMA}.outbox"


def pgbench(dsn: str, script: Path, clients: int, seconds: float) -> float:
    """Transactions per second of ``clients`` pgbench clients running ``script``."""
    out = subprocess.run(
        ["pgbench", "--no-vacuum", "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(int(seconds)),
         "-f", str(script), dsn],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    match = re.search(r"tps = ([\d.]+)", out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"bench_producer: pgbench failed: {out.stderr.strip().splitlines()[-1:]}")
    return float(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 s per measurement, one round")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    if shutil.which("pgbench") is None:
        raise SystemExit("bench_producer: pgbench is not installed (Debian: apt-get install postgresql-client)")
    if args.quick:
        args.seconds, args.rounds = 2, 1
    rates: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in args.producers:
                for variant in VARIANTS:
                    table = setup(args.dsn, variant)
                    script = Path(tmp) / "insert.sql"
                    script.write_text(INSERT_SCRIPT.format(table=table))
                    rate = pgbench(args.dsn, script, n, args.seconds)
                    rates.setdefault((variant, n), []).append(rate)
                    print(f"  round {r + 1}: {variant}, {n} producers: {rate:,.0f}/s", file=sys.stderr)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))

    med = {k: statistics.median(v) for k, v in rates.items()}
    header = ["producers", *VARIANTS]
    rows = []
    for n in args.producers:
        plain = med[(PLAIN, n)]
        cells = [f"{plain:,.0f}/s"] + [f"{med[(v, n)]:,.0f}/s ({med[(v, n)] / plain:.2f}x)" for v in VARIANTS[1:]]
        rows.append([str(n), *cells])
    print(f"\nsingle-row INSERT transactions, median of {args.rounds} rounds of {args.seconds:g} s each")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
