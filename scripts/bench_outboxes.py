"""Several outboxes in one relay process (docs/outboxes.md): fairness and what each costs.

    .venv/bin/python scripts/bench_outboxes.py                 # both measures
    .venv/bin/python scripts/bench_outboxes.py --only fairness --backlog 20000   # a smoke run

- **fairness**: one `relay start --config` process serving two outboxes of one database,
  the log destination (output discarded, so the relay's own loop is the bottleneck: the
  worst case for the quiet outbox). A quiet producer inserts one event into the quiet
  outbox every ``--interval``; its insert-to-done latency (created_at to done_at, both the
  database's clock) is measured with the busy outbox idle, then while the busy outbox
  drains a backlog of ``--backlog`` rows (100,000) in the same process. Goal (issue 41):
  the quiet outbox's p99 while the other drains within 2x of its p99 alone.
- **many**: ``--outboxes`` (50) idle outboxes, one schema each in one database, in one
  process against one outbox in one process: RSS, PostgreSQL connections the process
  holds (pg_stat_activity), and idle CPU over ``--idle-seconds``, in all and per outbox.

Each outbox is a schema of a scratch database made for the run and dropped after it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.db.names import OutboxNames
from relay.db.statements import schema_sql
from scripts.procstat import process_cpu, rss_mb

RELAY = str(Path(sys.executable).with_name("relay"))
DEFAULT_DSN = os.environ.get("RELAY_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def scratch_database(dsn: str) -> str:
    name = f"bench_outboxes_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(dsn, dbname=name)


def drop_database(dsn: str, scratch: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        name = str(conninfo_to_dict(scratch)["dbname"])
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def make_outboxes(dsn: str, count: int) -> list[OutboxNames]:
    made = [OutboxNames(schema=f"o{i:03d}", table="outbox") for i in range(count)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for names in made:
            with conn.transaction():
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
                conn.execute(names.render(schema_sql()))
    return made


def config(path: Path, dsn: str, outboxes: list[OutboxNames], workers: int = 1, extra: str = "") -> str:
    text = f'broker = "log"\ndsn = "{dsn}"\nworkers = {workers}\n{extra}'
    for names in outboxes:
        text += f'\n[[outboxes]]\nname = "{names.schema}"\nschema = "{names.schema}"\n'
    path.write_text(text)
    return str(path)


def start(config_path: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    return subprocess.Popen(
        [RELAY, "start", "--config", config_path, "--log-level", "warning", *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_started(dsn: str, outboxes: list[OutboxNames], timeout: float = 60) -> None:
    """Until the relay's listeners row (or a claim) shows every outbox's run is up."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            up = 0
            for names in outboxes:
                table = sql.Identifier(names.schema, f"{names.table}_listeners")
                up += bool(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0])  # type: ignore[index]
            if up == len(outboxes):
                return
            time.sleep(0.2)
    raise SystemExit("the relay did not start every outbox in time (its log: run it by hand)")


# ---- fairness


class QuietProducer:
    """One event into ``names`` every ``interval`` seconds, until stopped; the ids it wrote."""

    def __init__(self, dsn: str, names: OutboxNames, interval: float) -> None:
        self.dsn, self.names, self.interval = dsn, names, interval
        self.ids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QuietProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        insert = sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('q', %s, 'Quiet', '{{}}')"
            " RETURNING id"
        ).format(sql.Identifier(self.names.schema, self.names.table))
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            n = 0
            while not self._stop.is_set():
                n += 1
                row = conn.execute(insert, (f"q-{n % 50}",)).fetchone()
                assert row is not None
                self.ids.append(row[0])
                self._stop.wait(self.interval)


def latencies(dsn: str, names: OutboxNames, ids: list[int]) -> list[float]:
    """Milliseconds from insert to done of ``ids`` (the database's clock), once all are done."""
    table = sql.Identifier(names.schema, names.table)
    query = sql.SQL(
        "SELECT extract(epoch FROM done_at - created_at) * 1000 FROM {} WHERE id = ANY(%s) AND status = 'done'"
    ).format(table)
    deadline = time.monotonic() + 60
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            found = [float(r[0]) for r in conn.execute(query, (ids,)).fetchall()]
            if len(found) == len(ids) or time.monotonic() > deadline:
                return found
            time.sleep(0.2)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def backlog(dsn: str, names: OutboxNames, rows: int) -> None:
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                " SELECT 'b', 'b-' || (i %% 2000), 'Busy', jsonb_build_object('i', i) FROM generate_series(1, %s) AS i"
            ).format(table),
            (rows,),
        )


def pending(dsn: str, names: OutboxNames) -> int:
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE status IN ('pending', 'processing')").format(table)
        ).fetchone()
        assert row is not None
        return int(row[0])


def fairness(args: argparse.Namespace, work: Path) -> None:
    """The quiet outbox's latency alone and beside a drain: both outboxes in one process,
    then (for comparison, on the same cores) each in a process of its own."""
    one = quiet_latency(args, work, separate=False)
    apart = quiet_latency(args, work, separate=True)
    print(f"fairness: a quiet outbox's insert-to-done latency, one event every {args.interval * 1000:.0f} ms")
    for label, (alone_ms, beside_ms, drained_s) in (("one process", one), ("a process each", apart)):
        a50, a99, b50, b99 = pct(alone_ms, 50), pct(alone_ms, 99), pct(beside_ms, 50), pct(beside_ms, 99)
        print(f"  {label}:")
        print(f"    alone:                       p50 {a50:6.1f} ms  p99 {a99:6.1f} ms  ({len(alone_ms)} events)")
        print(
            f"    beside a {args.backlog:,}-row drain:  p50 {b50:6.1f} ms  p99 {b99:6.1f} ms  ({len(beside_ms)}"
            f" events; the drain took {drained_s:.1f} s, {args.backlog / drained_s:,.0f}/s)"
        )
        ratio = b99 / a99 if a99 else float("inf")
        verdict = f" (goal <= 2x): {'met' if ratio <= 2 else 'MISSED'}" if label == "one process" else ""
        print(f"    p99 beside / alone: {ratio:.2f}x{verdict}")


def quiet_latency(args: argparse.Namespace, work: Path, *, separate: bool) -> tuple[list[float], list[float], float]:
    dsn = scratch_database(args.dsn)
    try:
        quiet, busy = make_outboxes(dsn, 2)
        path = config(work / "fair.toml", dsn, [quiet, busy], args.workers, args.extra)
        processes = (
            [start(path, "--outbox", quiet.schema), start(path, "--outbox", busy.schema)] if separate else [start(path)]
        )
        try:
            wait_started(dsn, [quiet, busy])
            with QuietProducer(dsn, quiet, args.interval) as alone:
                time.sleep(args.alone_seconds)
            alone_ms = latencies(dsn, quiet, alone.ids)
            backlog(dsn, busy, args.backlog)
            began = time.monotonic()
            with QuietProducer(dsn, quiet, args.interval) as beside:
                while pending(dsn, busy) > 0:
                    time.sleep(0.5)
            drained_s = time.monotonic() - began
            beside_ms = latencies(dsn, quiet, beside.ids)
        finally:
            for process in processes:
                stop(process)
    finally:
        drop_database(args.dsn, dsn)
    return alone_ms, beside_ms, drained_s


# ---- many outboxes


def connections(dsn: str, pid_hint: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s",
            (conninfo_to_dict(dsn)["dbname"], pid_hint),
        ).fetchone()
        assert row is not None
        return int(row[0])


def idle_figures(dsn: str, outboxes: list[OutboxNames], work: Path, seconds: float) -> dict[str, float]:
    process = start(config(work / f"many-{len(outboxes)}.toml", dsn, outboxes))
    try:
        wait_started(dsn, outboxes)
        time.sleep(2)  # settled: first wake-ups and presence writes done
        cpu0, t0 = process_cpu(process.pid), time.monotonic()
        peak = 0
        while time.monotonic() - t0 < seconds:
            time.sleep(1)
            peak = max(peak, connections(dsn, "outbox-relay%"))
        cpu = (process_cpu(process.pid) - cpu0) / (time.monotonic() - t0)
        return {"rss": rss_mb(process.pid), "conns": peak, "cpu": cpu * 100}
    finally:
        stop(process)


def many(args: argparse.Namespace, work: Path) -> None:
    dsn = scratch_database(args.dsn)
    try:
        outboxes = make_outboxes(dsn, args.outboxes)
        one = idle_figures(dsn, outboxes[:1], work, args.idle_seconds)
        all_ = idle_figures(dsn, outboxes, work, args.idle_seconds)
    finally:
        drop_database(args.dsn, dsn)
    n = args.outboxes
    print(f"many: {n} idle outboxes in one process against one outbox alone (workers 1, wake-ups on)")
    print(f"  {'':<26}{'1 outbox':>12}{f'{n} outboxes':>14}{'per outbox':>14}{f'{n} processes':>16}")
    print(
        f"  {'RSS':<26}{one['rss']:>9.1f} MB{all_['rss']:>11.1f} MB"
        f"{(all_['rss'] - one['rss']) / (n - 1):>11.2f} MB{one['rss'] * n:>13.0f} MB"
    )
    print(
        f"  {'PostgreSQL connections':<26}{one['conns']:>12.0f}{all_['conns']:>14.0f}"
        f"{all_['conns'] / n:>14.2f}{one['conns'] * n:>16.0f}"
    )
    print(
        f"  {'idle CPU (% of a core)':<26}{one['cpu']:>12.2f}{all_['cpu']:>14.2f}"
        f"{all_['cpu'] / n:>14.3f}{one['cpu'] * n:>16.1f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dsn", default=DEFAULT_DSN)
    parser.add_argument("--only", choices=("fairness", "many"))
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2, help="each outbox's workers in the fairness run")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between the quiet outbox's events")
    parser.add_argument("--alone-seconds", type=float, default=10.0)
    parser.add_argument("--extra", default="", help="more top-level config lines, e.g. 'max_batch_size = 100'")
    parser.add_argument("--outboxes", type=int, default=50)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only in (None, "fairness"):
            fairness(args, work)
        if args.only in (None, "many"):
            many(args, work)


if __name__ == "__main__":
    main()
