"""The relay's own loop against the database legs alone: what the relay's per-message
machinery costs beyond its SQL.

    .venv/bin/python scripts/bench_loop.py                      # 100,000 rows, 3 rounds
    .venv/bin/python scripts/bench_loop.py --rows 20000 --rounds 1   # a smoke run
    .venv/bin/python scripts/bench_loop.py --profile            # also py-spy the relay (top entries)
    .venv/bin/python scripts/bench_loop.py --source ../before   # the relay of another checkout

Two legs, unordered and ordered, each over a fresh outbox of the same rows (``--rows`` over
``--aggregates`` aggregates, payloads of about 120 bytes):

- relay: `relay start --broker log --workers 4` as a subprocess, its output discarded: the
  whole loop (claims with the ingest, decoding, envelopes, outcomes, fenced finalizes) with a
  destination that costs almost nothing. Timed from the first row leaving 'pending' to the
  last one 'done'; start-up is not counted.
- database legs: the design reference's schema with the claim tuned to its indexes and one
  fenced finalize statement per batch, ordered by the head-of-aggregate NOT EXISTS (the
  "ceiling" of scripts/bench_db.py): ``--ceiling-workers`` loops in this process, a
  publisher that does nothing.

Rounds alternate the legs' order; the figures are medians over the rounds, and the ratio
the median of each round's ratio. CPU per message is counted for the relay process, for
PostgreSQL's processes, and for this process (the database legs' own Python). Goals (issue
40): >= 0.9x unordered, >= 0.8x ordered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import progress
from scripts.bench_db import BASE_SCHEMA, count_done, drain_baseline, fill, reset_base
from scripts.procstat import CpuMeter, process_cpu

RELAY = str(Path(sys.executable).with_name("relay"))
PY_SPY = str(Path(sys.executable).with_name("py-spy"))
DEFAULT_DSN = os.environ.get("RELAY_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")


@dataclass(frozen=True)
class Result:
    rate: float
    own_us: float  # the relay's (or the legs' Python) CPU per message
    pg_us: float

    def cell(self) -> str:
        return f"{self.rate:,.0f}/s (own {self.own_us:.0f} us, PG {self.pg_us:.0f} us)"


def relay_command(source: str | None) -> tuple[list[str], dict[str, str], str | None]:
    """How to run `relay` (its command, environment and directory): this checkout's, or
    (``source``) another checkout's package run by this interpreter from that checkout, for
    a before/after pair in one sitting (``-m`` puts the working directory first on the
    path, ahead of this checkout's editable install)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    if source is None:
        return [RELAY], env, None
    where = str(Path(source).resolve())
    return [sys.executable, "-m", "relay.cli"], {**env, "PYTHONPATH": where}, where


def relay_leg(
    dsn: str,
    rows: int,
    aggregates: int,
    ordered: bool,
    workers: int,
    batch: int,
    profile: str | None,
    source: str | None = None,
    extra: tuple[str, ...] = (),
) -> Result:
    schema = f"bench_loop_{uuid.uuid4().hex[:8]}"
    relay_cmd, env, cwd = relay_command(source)
    migrated = subprocess.run(
        [*relay_cmd, "migrate", "--dsn", dsn, "--schema", schema, "--ordering-default",
         "ordered" if ordered else "unordered", "--no-notify"],
        capture_output=True, text=True, env=env, check=False, cwd=cwd,
    )  # fmt: skip
    if migrated.returncode:
        raise SystemExit(f"relay migrate: {migrated.stderr.strip()}")
    table = sql.Identifier(schema, "outbox")
    try:
        fill(dsn, rows=rows, aggregates=aggregates, schemas=(schema,))
        waiting, moving = progress.waiting(table), progress.moving(table)  # polled every 20 ms
        with tempfile.TemporaryFile("w+") as log, psycopg.connect(dsn, autocommit=True) as conn:
            relay = subprocess.Popen(
                [*relay_cmd, "start", "--dsn", dsn, "--schema", schema, "--broker", "log", "--workers", str(workers),
                 "--batch-size", str(batch), "--log-level", "warning", *extra],
                stdout=subprocess.DEVNULL, stderr=log, env=env, cwd=cwd,
            )  # fmt: skip
            spy = None
            try:
                while not conn.execute(moving).fetchone()[0]:  # type: ignore[index]
                    if relay.poll() is not None:
                        log.seek(0)
                        raise SystemExit(f"relay exited: {log.read()[-2000:]}")
                    time.sleep(0.002)
                started = time.perf_counter()
                own0, meter = process_cpu(relay.pid), CpuMeter("postgres").start()
                if profile:
                    spy = subprocess.Popen(
                        [PY_SPY, "record", "--pid", str(relay.pid), "--format", "raw", "-o", profile,
                         "--rate", "200"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                while conn.execute(waiting).fetchone()[0]:  # type: ignore[index]
                    if relay.poll() is not None:
                        log.seek(0)
                        raise SystemExit(f"relay exited: {log.read()[-2000:]}")
                    time.sleep(0.02)
                took = time.perf_counter() - started
                own, pg = process_cpu(relay.pid) - own0, meter.stop()
            finally:
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(30)
                relay.send_signal(signal.SIGTERM)
                relay.wait(30)
        done = count_done(dsn, schema)
        if done != rows:
            raise SystemExit(f"relay leg: {done} of {rows} done")
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return Result(rows / took, own / rows * 1e6, pg / rows * 1e6)


def legs_alone(dsn: str, rows: int, aggregates: int, ordered: bool, workers: int, batch: int) -> Result:
    reset_base(dsn)
    fill(dsn, rows=rows, aggregates=aggregates, schemas=(BASE_SCHEMA,))
    meter, own0 = CpuMeter("postgres").start(), time.process_time()
    took = asyncio.run(drain_baseline(dsn, rows, workers, batch, ordered, batched=True))
    pg, own = meter.stop(), time.process_time() - own0
    done = count_done(dsn, BASE_SCHEMA)
    if done != rows:
        raise SystemExit(f"database legs: {done} of {rows} done")
    return Result(rows / took, own / rows * 1e6, pg / rows * 1e6)


def median(results: list[Result]) -> Result:
    return Result(*(statistics.median(getattr(r, f) for r in results) for f in ("rate", "own_us", "pg_us")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=DEFAULT_DSN)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--aggregates", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=4, help="the relay's (relay start --workers)")
    p.add_argument("--ceiling-workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--only", choices=("unordered", "ordered"))
    p.add_argument("--profile", action="store_true", help="py-spy the relay in the first round (raw stacks)")
    p.add_argument("--source", help="run the relay package of this checkout instead (a before/after pair)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        help="the relay's --max-batch-size (100: claims stay at --batch 100, as the legs')",
    )
    a = p.parse_args()
    kinds = [a.only == "ordered"] if a.only else [False, True]
    extra = ("--max-batch-size", str(a.max_batch_size)) if a.max_batch_size else ()
    goals = {False: 0.9, True: 0.8}
    summary: list[str] = []
    for ordered in kinds:
        kind = "ordered" if ordered else "unordered"
        relays: list[Result] = []
        bases: list[Result] = []
        ratios: list[float] = []
        for r in range(a.rounds):
            profile = f"/tmp/relay-loop-{kind}.txt" if a.profile and r == 0 else None
            legs: list[Any] = [
                lambda p=profile, o=ordered: relay_leg(
                    a.dsn, a.rows, a.aggregates, o, a.workers, a.batch, p, a.source, extra
                ),
                lambda o=ordered: legs_alone(a.dsn, a.rows, a.aggregates, o, a.ceiling_workers, a.batch),
            ]
            if r % 2:
                legs.reverse()
            first, second = (leg() for leg in legs)
            relay, base = (second, first) if r % 2 else (first, second)
            relays.append(relay)
            bases.append(base)
            ratios.append(relay.rate / base.rate)
            print(
                f"{kind} round {r + 1}: relay {relay.cell()}; database legs {base.cell()}; {ratios[-1]:.2f}x",
                flush=True,
            )
        ratio = statistics.median(ratios)
        verdict = "met" if ratio >= goals[ordered] else "MISSED"
        summary.append(
            f"{kind}: relay {median(relays).cell()} vs database legs {median(bases).cell()}:"
            f" {ratio:.2f}x (goal >= {goals[ordered]}x, {verdict})"
        )
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
