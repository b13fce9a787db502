"""The console and `relay dead list --group` at a million dead rows: time per page, the
console's memory, and whether /healthz waits behind heavy pages.

An outbox in a database of its own (``outbox_relay_bench_console``, dropped at the end)
holds ``--rows`` dead messages (default 1,000,000) over 100,000 distinct errors and
100,000 event types, one group much larger than the rest, and one message with a 26 MB
payload. The real `relay console` runs as a subprocess; each page is fetched three times
(the median is printed, each request capped at ``--timeout`` seconds), then three heavy
pages at once while /healthz is timed. RSS comes from /proc (VmRSS idle after start-up,
VmHWM the peak).

    .venv/bin/python scripts/bench_console.py                      # about 5 minutes
    .venv/bin/python scripts/bench_console.py --rows 100000        # a smoke run
    .venv/bin/python scripts/bench_console.py --relay /path/to/other/.venv/bin/relay
        # the same against another checkout (its own `relay migrate` makes the outbox)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
DATABASE = "outbox_relay_bench_console"
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def load(admin_dsn: str, relay: str, rows: int) -> str:
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        # What an interrupted run left connected (its console, its own session) goes first.
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (DATABASE,))
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(DATABASE)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    dsn = make_conninfo(admin_dsn, dbname=DATABASE)
    subprocess.run([relay, "migrate", "--dsn", dsn], check=True, capture_output=True)
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        # 100,000 distinct errors (words from the number, so they stay distinct once numbers
        # are replaced), one group of a tenth of the rows, 100,000 event types.
        conn.execute(
            """
            INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload, status, attempts,
                                       last_error, ordered)
            SELECT 'order', 'o-' || g, 'Type' || (g %% 100000), '{"n": 1}', 'dead', 3,
                   CASE WHEN g %% 10 = 0 THEN 'PermanentError: the broker refused order ' || g || ' (406)'
                        ELSE 'PermanentError: ' || translate((g %% 100000)::text, '0123456789', 'abcdefghij')
                             || ' refused message ' || g || ' after ' || (g %% 7) || ' tries' END,
                   false
              FROM generate_series(1, %s) AS g
            """,
            (rows,),
        )
        conn.execute(
            "INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload, status, attempts,"
            " last_error, ordered) VALUES ('order', 'big', 'Big', jsonb_build_object('blob', repeat('x', 26000000)),"
            " 'dead', 1, 'PermanentError: too large', false)"
        )
        conn.execute("VACUUM ANALYZE public.outbox")
    print(f"loaded {rows:,} dead rows in {time.monotonic() - started:.1f} s")
    return dsn


async def timed(session: aiohttp.ClientSession, url: str, limit_s: float) -> tuple[float, int, int]:
    """Seconds, status and bytes of one GET (status 0: it timed out)."""
    started = time.monotonic()
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=limit_s)) as r:
            body = await r.read()
            return time.monotonic() - started, r.status, len(body)
    except TimeoutError:
        return time.monotonic() - started, 0, 0


async def measure(dsn: str, relay: str, timeout: float, runs: int) -> None:  # noqa: ASYNC109 (a per-request cap)
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before any request)
        [relay, "console", "--dsn", dsn, "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                try:
                    async with session.get(base + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.1)
            idle = rss_kib(proc.pid, "VmRSS")
            with psycopg.connect(dsn) as conn:
                big_id = conn.execute("SELECT id FROM public.outbox WHERE aggregate_id = 'big'").fetchone()
            _, _, dead_page = await timed(session, base + "/dead", timeout)
            async with session.get(base + "/dead") as r:
                text = await r.text()
            keys = re.findall(r'data-testid="group-([0-9a-f]+)"', text)
            pages = {
                "/ (overview)": "/",
                "/fragments/overview": "/fragments/overview",
                "/dead": "/dead",
                "/dead?page=2000 (the last)": "/dead?page=2000",
                "/dead/KEY (100,000 rows)": f"/dead/{keys[0]}" if keys else "/dead",
                "/dead/KEY?after=500000": f"/dead/{keys[0]}?after=500000" if keys else "/dead",
                "/dead?error=refused": "/dead?error=refused",
                "/messages/ID (26 MB payload)": f"/messages/{big_id[0] if big_id else 1}",
                "/messages/ID/payload (streamed)": f"/messages/{big_id[0] if big_id else 1}/payload",
                "/blocked": "/blocked",
            }
            print(f"console RSS idle: {idle / 1024:.0f} MiB; /dead is {dead_page:,} bytes")
            print(f"| page | median of {runs} | status | bytes |\n|---|---|---|---|")
            for label, path in pages.items():
                got = [await timed(session, base + path, timeout) for _ in range(runs)]
                seconds = statistics.median(r[0] for r in got)
                status, size = got[-1][1], got[-1][2]
                shown = f"over {timeout:g} s" if status == 0 else f"{seconds:.2f} s"
                print(f"| {label} | {shown} | {status} | {size:,} |")
            heavy = [base + "/dead", base + (f"/dead/{keys[0]}" if keys else "/dead"), base + "/"]
            tasks = [asyncio.create_task(timed(session, u, timeout)) for u in heavy]
            await asyncio.sleep(0.05)
            waits = []
            while not all(t.done() for t in tasks):
                waits.append((await timed(session, base + "/healthz", timeout))[0])
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks)
            print(f"/healthz during 3 heavy pages: worst {max(waits or [0]) * 1000:.0f} ms over {len(waits)} probes")
            print(f"console RSS peak: {rss_kib(proc.pid, 'VmHWM') / 1024:.0f} MiB (idle {idle / 1024:.0f} MiB)")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    started = time.monotonic()
    out = subprocess.run(  # noqa: ASYNC221 (timed alone, after the console stopped)
        [relay, "dead", "list", "--group", "--dsn", dsn], capture_output=True, text=True, timeout=timeout * 3
    )
    print(
        f"relay dead list --group: {time.monotonic() - started:.2f} s (exit {out.returncode}, a process start included)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN), help="a server to create the database on"
    )
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--relay", default=str(ROOT / ".venv" / "bin" / "relay"))
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--runs", type=int, default=3, help="requests per page (the median is printed)")
    ap.add_argument("--keep", action="store_true", help="leave the database")
    args = ap.parse_args()
    if not shutil.which(args.relay):
        raise SystemExit(f"bench_console: no relay at {args.relay}")
    if conninfo_to_dict(args.dsn).get("dbname") == DATABASE:
        raise SystemExit("bench_console: give a DSN of another database on the server")
    dsn = load(args.dsn, args.relay, args.rows)
    try:
        asyncio.run(measure(dsn, args.relay, args.timeout, args.runs))
    finally:
        if not args.keep:
            with psycopg.connect(args.dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(DATABASE)))


if __name__ == "__main__":
    sys.exit(main())
