"""What the relay costs the producers' own transactions: insert rate into the design
reference's plain outbox table beside a `relay migrate`d one, same run, same machine.

The relay's triggers (routing at insert, which also sends the wake-up while a relay is
idle, and the commit stamp at COMMIT) and its indexes run inside every producer
transaction, so they are part of what users pay. Each producer is a pgbench client
inserting single-row transactions (autocommit) into a fresh table; variants and producer
counts alternate within every round, and the median of the rounds is printed. Beside the
rate, the CPU time the producers' own PostgreSQL backends spent per transaction (read from
/proc while they run): the cost itself, steadier than a rate when other work shares the
machine.

Producers send a wake-up (NOTIFY) only while every relay is idle (migrations 0007, 0008),
so the relay schema is measured in three states: a relay working (what producers pay under
load), a relay idle (every insert notifies: what they pay while nothing else happens), and
wake-ups off for the whole outbox (``relay settings set --no-notify``). The relay's state
is written with the relays' own statements, valid for an hour; no relay runs. Two more
rows take the relay schema apart, with a relay working: without the commit stamp, and
without any relay trigger (the table, its defaults, constraints and indexes alone). The
first row after the plain table is the schema before migration 0008, the baseline of the
change that made inserts cheaper.

    .venv/bin/python scripts/bench_producer.py               # about 6 minutes
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.db.commit_order import CommitOrder
from relay.db.names import OutboxNames
from relay.db.settings import SettingsUpdate, update_settings
from relay.db.statements import migrations, named_queries
from scripts.procstat import process_cpu
from scripts.reference_schema import REFERENCE_DDL

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_producer"
NAMES = OutboxNames(SCHEMA)
BEFORE_VERSION = 7  # the last migration before inserts were made cheaper (0008)


# One event per transaction, 1,000 aggregates, a payload of about 100 bytes.
INSERT_SCRIPT = """\\set a random(1, 1000)
INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', 'order-' || :a, 'OrderPaid',
        '{{"order_id": 42, "amount": "19.90", "currency": "EUR", "note": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}');
"""


@dataclass(frozen=True)
class Variant:
    label: str
    version: int | None = None  # migrations applied; None: the plain table
    relay: str | None = "working"  # the relays' state: working, idle, or None (wake-ups off)
    disabled: tuple[str, ...] = ()  # relay triggers switched off, to see what the rest costs
    commit_order: CommitOrder = "stamp"  # relay settings set --commit-order


PLAIN = Variant("plain table")
VARIANTS = (
    PLAIN,
    Variant("relay schema before 0008, a relay working", version=BEFORE_VERSION),
    Variant("relay schema, wake-ups on, a relay working"),
    Variant("relay schema, wake-ups on, a relay idle", relay="idle"),
    Variant("relay schema, `--no-notify`", relay=None),
    Variant("relay schema, a relay working, no commit stamp", disabled=("stamp",)),
    Variant("relay schema, `--commit-order id`, a relay working", commit_order="id"),
    Variant("relay schema, no relay triggers", disabled=("stamp", "route")),
)
# --compare-commit-order: the commit stamp (any producer) against --commit-order id
# (producers that lock the aggregate), alternating within every round.
COMPARE_COMMIT_ORDER = (
    PLAIN,
    Variant("relay schema, `--commit-order stamp`, a relay working"),
    Variant("relay schema, `--commit-order id`, a relay working", commit_order="id"),
)
# --compare-0011: the commit stamp drawn as the producer (0010) and as the owner (0011:
# SECURITY DEFINER with a pinned search_path, one user switch and one search_path save and
# restore per ordered row), alternating within every round.
COMPARE_0011 = (
    PLAIN,
    Variant("relay schema at 0010 (stamp as the producer), a relay working", version=10),
    Variant("relay schema at 0011 (stamp as the owner), a relay working"),
)

# --compare-0015: the event identity (an event_id drawn by gen_random_uuid() for every row,
# 16 bytes more per row) against the schema before it, alternating within every round.
COMPARE_0015 = (
    PLAIN,
    Variant("relay schema at 0013 (no event_id), a relay working", version=13),
    Variant("relay schema at 0015 (event_id by the database), a relay working"),
)


def setup(dsn: str, variant: Variant) -> str:
    """A fresh table for ``variant``; returns its qualified name for the pgbench script."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        table = sql.Identifier(SCHEMA, "outbox")
        if variant.version is None and variant is PLAIN:
            conn.execute(sql.SQL(REFERENCE_DDL).format(t=table))
        else:
            with conn.transaction():
                for number, _, text in migrations():
                    if variant.version is None or number <= variant.version:
                        conn.execute(NAMES.render(text))
            # The default map (every type ordered), as a relay that never stored one leaves it.
            conn.execute(
                sql.SQL("UPDATE {} SET notify = %s").format(sql.Identifier(SCHEMA, "outbox_settings")),
                (variant.relay is not None,),
            )
            # One relay process, as it records itself (relay.wakeup.Presence); with wake-ups
            # off no relay LISTENs, so none has a row.
            if variant.relay is not None:
                before_0008 = variant.version is not None and variant.version < 8
                _record_relay(conn, idle=variant.relay == "idle", before_0008=before_0008)
            if variant.commit_order != "stamp":
                asyncio.run(_switch(dsn, variant.commit_order))
            for trigger in variant.disabled:
                conn.execute(
                    sql.SQL("ALTER TABLE {} DISABLE TRIGGER {}").format(table, sql.Identifier(f"outbox_{trigger}"))
                )
        conn.execute("CHECKPOINT")
    return f"{SCHEMA}.outbox"


async def _switch(dsn: str, mode: CommitOrder) -> None:
    """`relay settings set --commit-order MODE`, as the owner."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await update_settings(conn, NAMES, SettingsUpdate(commit_order=mode))


def switch_cost(dsn: str, rows: int) -> None:
    """How long `relay settings set --commit-order` holds the outbox, with ``rows`` rows in
    it (delivered history, and 1,000 ordered rows waiting to be numbered), each way."""
    setup(dsn, Variant("switch"))
    table = sql.Identifier(SCHEMA, "outbox")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, done_at, aggregate_seq)"
                " SELECT 'order', 'order-' || (g %% 10000), 'OrderPaid', '{{\"n\": 1}}', 'done', now(), g"
                " FROM generate_series(1, %s) AS g"
            ).format(table),
            (rows,),
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'order', 'fresh-' || (g % 100), 'OrderPaid', '{{}}' FROM generate_series(1, 1000) AS g"
            ).format(table)
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))
    modes: tuple[CommitOrder, ...] = ("id", "stamp")
    for mode in modes:
        started = time.perf_counter()
        asyncio.run(_switch(dsn, mode))
        print(
            f"switch to --commit-order {mode} with {rows:,} rows in the outbox: {time.perf_counter() - started:.2f} s"
        )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))


def _record_relay(conn: psycopg.Connection[Any], *, idle: bool, before_0008: bool) -> None:
    queries = named_queries()
    params = {"owner": "bench:1", "idle": idle, "ttl": "1 hour"}
    if before_0008:  # then the producers' trigger read <table>_listeners itself
        conn.execute(NAMES.render(queries["listener_set"]), params)
        return
    with conn.transaction():
        for name in ("listener_turn", "listener_set", "listener_answer"):
            conn.execute(NAMES.render(queries[name]), params if name == "listener_set" else None)


@dataclass(frozen=True)
class Sample:
    rate: float  # transactions per second, as pgbench reports it
    cpu_us: float  # CPU time of the producers' backends per transaction, in microseconds


def _backend_cpu(dsn: str, seconds: float, out: list[float]) -> None:
    """The producers' backends' CPU per committed row over the middle of a run (the first
    and last fifth left out: connecting and disconnecting are not inserts)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        time.sleep(seconds / 5)
        pids = [r[0] for r in conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = 'pgbench'")]
        count = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(SCHEMA, "outbox"))

        def rows() -> int:
            row = conn.execute(count).fetchone()
            return int(row[0]) if row else 0

        cpu0, rows0 = sum(process_cpu(p) for p in pids), rows()
        time.sleep(seconds * 3 / 5)
        cpu1, rows1 = sum(process_cpu(p) for p in pids), rows()
    if rows1 > rows0 and pids:
        out.append((cpu1 - cpu0) / (rows1 - rows0) * 1e6)


def pgbench(dsn: str, script: Path, clients: int, seconds: float) -> Sample:
    """Rate and backend CPU per transaction of ``clients`` pgbench clients running ``script``."""
    cpu: list[float] = []
    watcher = threading.Thread(target=_backend_cpu, args=(dsn, seconds, cpu))
    watcher.start()
    out = subprocess.run(
        ["pgbench", "--no-vacuum", "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(int(seconds)),
         "-f", str(script), dsn],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    watcher.join()
    match = re.search(r"tps = ([\d.]+)", out.stdout)
    if out.returncode != 0 or not match:
        raise SystemExit(f"bench_producer: pgbench failed: {out.stderr.strip().splitlines()[-1:]}")
    return Sample(float(match.group(1)), cpu[0] if cpu else float("nan"))


# -- what each part costs: one session, no network, no fsync ------------------------

# Each part of the relay schema taken away on its own, from the full schema with a relay
# working; the plain table last. ``{t}`` is the outbox, ``{s}`` its schema.
PARTS: tuple[tuple[str, str | None], ...] = (
    ("relay schema, a relay working (all parts)", ""),
    ("  without the commit stamp trigger", "ALTER TABLE {t} DISABLE TRIGGER outbox_stamp"),
    # As before migration 0011: the same function, run with the inserting role's privileges.
    (
        "  the commit stamp as the producer (0010)",
        "ALTER FUNCTION {s}.outbox_stamp() SECURITY INVOKER RESET search_path",
    ),
    # SECURITY DEFINER alone, to tell the user switch from the search_path save and restore.
    ("  the commit stamp as the owner, search_path not pinned", "ALTER FUNCTION {s}.outbox_stamp() RESET search_path"),
    ("  without the routing trigger", "ALTER TABLE {t} DISABLE TRIGGER outbox_route"),
    # The event identity (0015): one gen_random_uuid() and 16 bytes per row.
    ("  without the event_id default", "ALTER TABLE {t} ALTER COLUMN event_id DROP DEFAULT"),
    ("  without both triggers", "ALTER TABLE {t} DISABLE TRIGGER outbox_stamp, DISABLE TRIGGER outbox_route"),
    (
        "  without the CHECK constraints",
        "ALTER TABLE {t} DROP CONSTRAINT outbox_status_check, DROP CONSTRAINT outbox_attempts_check,"
        " DROP CONSTRAINT outbox_lease_check, DROP CONSTRAINT outbox_aggregate_id_length",
    ),
    ("  without the xid column's default", "ALTER TABLE {t} ALTER COLUMN xid SET DEFAULT '0'"),
    ("  without the index outbox_fresh_idx", "DROP INDEX {s}.outbox_fresh_idx"),
    (
        "  without the 8 indexes an insert does not write",
        "DROP INDEX {s}.outbox_aggregate_seq_idx, {s}.outbox_dead_idx, {s}.outbox_leased_idx,"
        " {s}.outbox_one_in_flight_idx, {s}.outbox_unordered_ready_idx, {s}.outbox_dead_group_idx,"
        " {s}.outbox_dead_type_idx, {s}.outbox_dead_ordered_idx",
    ),
    ("plain table", None),
)

PROCEDURE = """CREATE PROCEDURE {s}.bench_insert(n int) LANGUAGE plpgsql AS $$
BEGIN
    FOR i IN 1..n LOOP
        INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload)
        VALUES ('order', 'order-' || (i % 1000), 'OrderPaid',
                '{{"order_id": 42, "amount": "19.90", "currency": "EUR", "note": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"}}');
        COMMIT;
    END LOOP;
END $$"""


def parts(dsn: str, rounds: int, transactions: int) -> list[tuple[str, float]]:
    """Backend CPU per single-row transaction for each variant of PARTS, least of ``rounds``:
    a procedure commits after every insert inside one backend, with synchronous_commit off,
    so only the server's own work per transaction is counted."""
    best: dict[str, float] = {}
    ident = {"s": sql.Identifier(SCHEMA), "t": sql.Identifier(SCHEMA, "outbox")}
    for _ in range(rounds):
        for label, change in PARTS:
            setup(dsn, PLAIN if change is None else VARIANTS[2])
            with psycopg.connect(dsn, autocommit=True) as conn:
                if change:
                    conn.execute(sql.SQL(change).format(**ident))
                conn.execute(sql.SQL(PROCEDURE).format(**ident))
                conn.execute("SET synchronous_commit = off")
                conn.execute(sql.SQL("CALL {}.bench_insert(200)").format(ident["s"]))  # warm caches
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                assert row is not None
                before = process_cpu(row[0])
                conn.execute(sql.SQL("CALL {}.bench_insert(%s)").format(ident["s"]), (transactions,))
                us = (process_cpu(row[0]) - before) / transactions * 1e6
            best[label] = min(us, best.get(label, us))
            print(f"  {label.strip()}: {us:.1f} us", file=sys.stderr)
    return list(best.items())


def print_parts(results: list[tuple[str, float]], markdown: bool) -> None:
    full = results[0][1]
    print("\nserver CPU per single-row transaction, one session (least of the rounds); difference to all parts")
    rows = [(label, f"{us:.1f} us", "" if i == 0 else f"{us - full:+.1f} us") for i, (label, us) in enumerate(results)]
    if markdown:
        print("| variant | CPU per transaction | difference |\n|---|---|---|")
        for row in rows:
            print(f"| {row[0].strip()} | {row[1]} | {row[2]} |")
    else:
        for row in rows:
            print(f"  {row[0]:<52} {row[1]:>10}  {row[2]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--producers", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 s per measurement, one round")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--parts", action="store_true", help="only what each part of the schema costs (about 1 minute)")
    ap.add_argument("--compare-0011", action="store_true", help="only the plain table, 0010 and 0011 (stamp as owner)")
    ap.add_argument("--compare-0015", action="store_true", help="only the plain table, 0013 and 0015 (event_id)")
    ap.add_argument(
        "--compare-commit-order", action="store_true", help="only the plain table, --commit-order stamp and id"
    )
    ap.add_argument("--switch", type=int, metavar="ROWS", help="only time the switch of --commit-order at ROWS rows")
    args = ap.parse_args()
    if args.switch:
        switch_cost(args.dsn, args.switch)
        return
    variants = (
        COMPARE_0011
        if args.compare_0011
        else COMPARE_0015
        if args.compare_0015
        else COMPARE_COMMIT_ORDER
        if args.compare_commit_order
        else VARIANTS
    )
    if args.parts:
        print_parts(
            parts(args.dsn, rounds=1 if args.quick else 3, transactions=2000 if args.quick else 20000), args.markdown
        )
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        return
    if shutil.which("pgbench") is None:
        raise SystemExit("bench_producer: pgbench is not installed (Debian: apt-get install postgresql-client)")
    if args.quick:
        args.seconds, args.rounds = 2, 1
    samples: dict[tuple[Variant, int], list[Sample]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in args.producers:
                for variant in variants:
                    table = setup(args.dsn, variant)
                    script = Path(tmp) / "insert.sql"
                    script.write_text(INSERT_SCRIPT.format(table=table))
                    got = pgbench(args.dsn, script, n, args.seconds)
                    samples.setdefault((variant, n), []).append(got)
                    print(
                        f"  round {r + 1}: {variant.label}, {n} producers: {got.rate:,.0f}/s, {got.cpu_us:.0f} us CPU",
                        file=sys.stderr,
                    )
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))
        autovacuum = conn.execute("SHOW autovacuum").fetchone()

    rate = {k: statistics.median(x.rate for x in v) for k, v in samples.items()}
    cpu = {k: statistics.median(x.cpu_us for x in v) for k, v in samples.items()}
    header = ["variant", *(f"{n} producers" for n in args.producers)]
    rows = []
    for variant in variants:
        cells = []
        for n in args.producers:
            ratio = "" if variant is PLAIN else f" ({rate[(variant, n)] / rate[(PLAIN, n)]:.2f}x)"
            cells.append(f"{rate[(variant, n)]:,.0f}/s{ratio}, {cpu[(variant, n)]:.0f} us")
        rows.append([variant.label, *cells])
    print(
        f"\nsingle-row INSERT transactions, median of {args.rounds} rounds of {args.seconds:g} s each:"
        " rate (ratio to the plain table), CPU of the producers' backends per transaction"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; autovacuum {autovacuum[0] if autovacuum else '?'}")
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
