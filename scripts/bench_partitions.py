"""A partitioned outbox (relay.db.partitions) beside a plain one, same run, same rows.

(a) Retention of ``--rows`` done rows: `relay prune` on a partitioned outbox (detach and drop
    whole partitions) against `relay prune` on a plain one (today's batched DELETE, 5,000 ids
    a statement): wall time, WAL written (pg_current_wal_lsn before and after) and the
    table's size afterwards (table, partitions, indexes and TOAST; autovacuum off, as on the
    servers the issue is about, so the DELETE's dead tuples stay).
(b) Claim latency of the relay's own claim (relay.db.dispatch.OutboxStore.claim, ingest
    included) on an outbox of 30 partitions against a plain one holding the same rows:
    ``--claim-rows`` done rows and ``--pending`` pending ones (half ordered over
    ``--aggregates`` aggregates, half unordered); p50/p99 over every claim of the drain.
(c) What time partitioning was expected to cost: a lookup by ``id = ANY(10 ids)`` (what the claim's
    head probe, finalize and payload_of do) on a table partitioned by created_at (30 daily
    partitions, primary key (id, created_at): no pruning by id) against by id and plain.
(d) ``--only time-claims``: the claim (as in (b), ``--claims`` claims of batch 10, each
    finalized) on an outbox partitioned by time (``relay migrate --partition-by time
    --partition-interval 1h``, 10 hourly partitions: 8 past ones made as an earlier
    keep_ahead would have, holding the done rows, now's with the pending rows, and one ahead)
    against a plain outbox holding the same rows.
(e) ``--only drop-pause``: how long ordered numbering pauses while `relay prune` drops a
    partition (the ingest's turn is held from before the detach until the drop or the
    attach: relay.db.partitions), 10 finished partitions of 1,000 rows dropped while a
    producer commits one ordered row every 5 ms; then again with one producer transaction
    kept open for 2 s over the prune (the detach waits for every transaction using the
    outbox, so numbering pauses that long).

Rows are loaded with INSERT ... SELECT generate_series, the outbox's triggers off
(session_replication_role = replica: a superuser's DSN), into a scratch schema dropped at
the end.

    .venv/bin/python scripts/bench_partitions.py                     # 10,000,000 rows: disk!
    .venv/bin/python scripts/bench_partitions.py --rows 2000000      # what BENCHMARKS.md shows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from relay.db import partitions
from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.partitions import PartitionSpec, keep_ahead
from relay.message import Decision
from relay.retention import prune

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
# Done rows as the relay leaves them, created and finished two days before the run.
LOAD = """
INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, created_at, status, done_at,
                 ordered, aggregate_seq, payload_bytes, xid)
SELECT 'order', 'agg-' || (g %% %(aggregates)s), 'OrderPlaced',
       jsonb_build_object('n', g, 'note', 'a payload of about a hundred bytes, as small events carry'),
       now() - interval '3 days' + g * interval '1 millisecond', 'done',
       now() - interval '2 days' + g * interval '1 millisecond',
       g %% 2 = 0, CASE WHEN g %% 2 = 0 THEN g / 2 END, 100, '1'
  FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
"""


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(conn: psycopg.AsyncConnection[Any], names: OutboxNames, rows: int, aggregates: int) -> None:
    await conn.execute("SET session_replication_role = replica")
    step = 1_000_000
    for first in range(1, rows + 1, step):
        await conn.execute(
            sql.SQL(LOAD).format(t=sql.Identifier(names.schema, names.table)),
            {"aggregates": aggregates, "first": first, "last": min(rows, first + step - 1)},
        )
    await conn.execute("SET session_replication_role = DEFAULT")
    await conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(names.schema, names.table)))


async def size_of(conn: psycopg.AsyncConnection[Any], names: OutboxNames) -> int:
    cur = await conn.execute(
        "SELECT coalesce((SELECT sum(pg_total_relation_size(t.relid)) FROM pg_partition_tree(%s::regclass) t),"
        " pg_total_relation_size(%s::regclass))::bigint",
        (names.qualified, names.qualified),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def wal(conn: psycopg.AsyncConnection[Any]) -> str:
    cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def wal_since(conn: psycopg.AsyncConnection[Any], lsn: str) -> int:
    cur = await conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)::bigint", (lsn,))
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def new_outbox(
    conn: psycopg.AsyncConnection[Any], schema: str, table: str, spec: PartitionSpec | None
) -> OutboxNames:
    names = OutboxNames(schema, table)
    await migrate(conn, names, spec)
    return names


async def retention(dsn: str, schema: str, rows: int) -> list[tuple[str, float, int, int, int]]:
    out = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for label, spec in (("batched DELETE (plain)", None), ("drop partitions", PartitionSpec(rows // 10, 11))):
            names = await new_outbox(conn, schema, "ret_" + ("plain" if spec is None else "part"), spec)
            await load(conn, names, rows, 10_000)
            before = await size_of(conn, names)
            lsn = await wal(conn)
            started = time.perf_counter()
            result = await prune(conn, names, timedelta(hours=1))
            wall = time.perf_counter() - started
            out.append((label, wall, await wal_since(conn, lsn), before, await size_of(conn, names)))
            print(f"  {label}: {result.deleted:,} rows in {wall:.1f} s", file=sys.stderr)
    return out


async def claims(dsn: str, schema: str, rows: int, pending: int, aggregates: int) -> list[tuple[str, list[float]]]:
    out = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        made = []
        for table, spec in (("claim_plain", None), ("claim_part", PartitionSpec((rows + pending) // 29, 31))):
            names = await new_outbox(conn, schema, table, spec)
            await load(conn, names, rows, aggregates)
            await keep_ahead(conn, names)
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', CASE WHEN g %% 2 = 0 THEN 'agg-' || (g %% %s) ELSE 'u-' || g END,"
                    " CASE WHEN g %% 2 = 0 THEN 'OrderPlaced' ELSE 'EmailQueued' END, '{{\"n\": 1}}'"
                    " FROM generate_series(1, %s) g"
                ).format(sql.Identifier(names.schema, names.table)),
                (aggregates, pending),
            )
            await conn.execute(
                sql.SQL("UPDATE {} SET ordered = false WHERE event_type = 'EmailQueued' AND status = 'pending'").format(
                    sql.Identifier(names.schema, names.table)
                )
            )
            await conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(names.schema, names.table)))
            made.append((table, names))
        for table, names in made:
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                dsn, min_size=2, max_size=4, open=False, kwargs={"autocommit": True}
            )
            await pool.open(wait=True)
            store = OutboxStore(pool, names)
            times: list[float] = []
            empty = 0
            try:
                while empty < 3:  # the drain is over once three claims in a row find nothing
                    started = time.perf_counter()
                    claim = await store.claim(owner="bench", batch=10, lease=timedelta(seconds=30), max_attempts=5)
                    elapsed = time.perf_counter() - started
                    if not claim.messages:
                        empty += 1
                        continue
                    empty = 0
                    times.append(elapsed)
                    await store.finalize([Decision.published(m) for m in claim.messages])
            finally:
                await pool.close()
            out.append(("30 partitions" if table == "claim_part" else "plain", times))
    return out


# Done rows spread over the 8 hours before the current one (hourly partitions by time).
LOAD_PAST_HOURS = """
INSERT INTO {t} (aggregate_type, aggregate_id, event_type, payload, created_at, status, done_at,
                 ordered, aggregate_seq, payload_bytes, xid)
SELECT 'order', 'agg-' || (g %% %(aggregates)s), 'OrderPlaced',
       jsonb_build_object('n', g, 'note', 'a payload of about a hundred bytes, as small events carry'),
       %(start)s + g * (interval '8 hours' / (%(rows)s + 1)), 'done', now() - interval '1 minute',
       g %% 2 = 0, CASE WHEN g %% 2 = 0 THEN g / 2 END, 100, '1'
  FROM generate_series(1, %(rows)s) AS g
"""


async def past_hours(conn: psycopg.AsyncConnection[Any], names: OutboxNames, start: Any, hours: int) -> None:
    """Hourly partitions from ``start``, made as keep_ahead makes its own (it makes only now's
    and those ahead), with the two unique indexes each partition carries."""
    outbox = sql.Identifier(names.schema, names.table)
    for n in range(hours):
        lo = start + timedelta(hours=n)
        name = f"{names.table}_p{lo:%Y%m%d%H}"
        part = sql.Identifier(names.schema, name)
        like = sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        await conn.execute(like.format(part, outbox))
        await conn.execute(
            sql.SQL("CREATE UNIQUE INDEX {} ON {} (aggregate_id) WHERE ordered AND status = 'processing'").format(
                sql.Identifier(name + "_in_flight"), part
            )
        )
        await conn.execute(
            sql.SQL(
                "CREATE UNIQUE INDEX {} ON {} (aggregate_id, aggregate_seq) WHERE ordered"
                " AND status IN ('pending', 'processing', 'dead') AND aggregate_seq IS NOT NULL"
            ).format(sql.Identifier(name + "_seq"), part)
        )
        await conn.execute(
            sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                outbox, part, sql.Literal(lo), sql.Literal(lo + timedelta(hours=1))
            )
        )


async def time_claims(
    dsn: str, schema: str, rows: int, pending: int, aggregates: int, count: int
) -> list[tuple[str, list[float], int]]:
    out = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("SET TimeZone = 'UTC'")
        cur = await conn.execute("SELECT date_bin('1 hour', now(), timestamptz '1970-01-01 00:00:00+00')")
        row = await cur.fetchone()
        assert row is not None
        start = row[0] - timedelta(hours=8)
        made = []
        for table, spec in (("tclaim_plain", None), ("tclaim_time", PartitionSpec(span=timedelta(hours=1), ahead=1))):
            names = await new_outbox(conn, schema, table, spec)
            if spec is not None:
                await past_hours(conn, names, start, 8)
            t = sql.Identifier(names.schema, names.table)
            await conn.execute("SET session_replication_role = replica")
            params = {"aggregates": aggregates, "start": start, "rows": rows}
            await conn.execute(sql.SQL(LOAD_PAST_HOURS).format(t=t), params)
            await conn.execute("SET session_replication_role = DEFAULT")
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
                    " SELECT 'order', CASE WHEN g %% 2 = 0 THEN 'agg-' || (g %% %s) ELSE 'u-' || g END,"
                    " CASE WHEN g %% 2 = 0 THEN 'OrderPlaced' ELSE 'EmailQueued' END, '{{\"n\": 1}}'"
                    " FROM generate_series(1, %s) g"
                ).format(t),
                (aggregates, pending),
            )
            unordered = "UPDATE {} SET ordered = false WHERE event_type = 'EmailQueued' AND status = 'pending'"
            await conn.execute(sql.SQL(unordered).format(t))
            await conn.execute(sql.SQL("ANALYZE {}").format(t))
            cur = await conn.execute(
                "SELECT count(*) FROM pg_partition_tree(%s::regclass) WHERE isleaf AND level > 0", (names.qualified,)
            )
            parts = await cur.fetchone()
            made.append((table, names, int(parts[0]) if parts else 0))
        for _table, names, parts in made:
            pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                dsn, min_size=2, max_size=4, open=False, kwargs={"autocommit": True}
            )
            await pool.open(wait=True)
            store = OutboxStore(pool, names)
            times: list[float] = []
            try:
                while len(times) < count:
                    started = time.perf_counter()
                    claim = await store.claim(owner="bench", batch=10, lease=timedelta(seconds=30), max_attempts=5)
                    elapsed = time.perf_counter() - started
                    if not claim.messages:
                        break
                    times.append(elapsed)
                    await store.finalize([Decision.published(m) for m in claim.messages])
            finally:
                await pool.close()
            out.append(("plain" if parts == 0 else f"by time, {parts} partitions", times, parts))
    return out


async def lookups(dsn: str, schema: str, rows: int, samples: int) -> list[tuple[str, list[float]]]:
    out = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        plain = sql.Identifier(schema, "claim_plain")
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {t} (LIKE {p} INCLUDING DEFAULTS) PARTITION BY RANGE (created_at);"
                "ALTER TABLE {t} ADD PRIMARY KEY (id, created_at)"
            ).format(t=sql.Identifier(schema, "by_time"), p=plain)
        )
        cur = await conn.execute(sql.SQL("SELECT min(created_at), max(created_at) FROM {}").format(plain))
        row = await cur.fetchone()
        assert row is not None
        lo, hi = row
        step = (hi - lo) / 30 + timedelta(microseconds=1)
        for i in range(30):
            await conn.execute(
                sql.SQL("CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier(schema, f"by_time_{i}"),
                    sql.Identifier(schema, "by_time"),
                    sql.Literal(lo + i * step if i else lo - timedelta(days=1)),
                    sql.Literal(lo + (i + 1) * step if i < 29 else hi + timedelta(days=1)),
                )
            )
        await conn.execute(sql.SQL("INSERT INTO {} SELECT * FROM {}").format(sql.Identifier(schema, "by_time"), plain))
        await conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, "by_time")))
        rng = random.Random(2)
        for label, table in (("plain", "claim_plain"), ("by id, 30", "claim_part"), ("by time, 30", "by_time")):
            statement = sql.SQL("SELECT id, status, payload FROM {} WHERE id = ANY(%s)").format(
                sql.Identifier(schema, table)
            )
            times = []
            for _ in range(samples):
                ids = [rng.randint(1, rows) for _ in range(10)]
                started = time.perf_counter()
                await (await conn.execute(statement, (ids,))).fetchall()
                times.append(time.perf_counter() - started)
            out.append((label, times))
    return out


def insert_one(names: OutboxNames) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
        " VALUES ('order', 'p', 'OrderPlaced', '{{}}')"
    ).format(sql.Identifier(names.schema, names.table))


async def produce(dsn: str, names: OutboxNames, stop: asyncio.Event) -> None:
    """One ordered row a transaction, every 5 ms, until ``stop``."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while not stop.is_set():
            await conn.execute(insert_one(names))
            await asyncio.sleep(0.005)


async def hold_open(dsn: str, names: OutboxNames, seconds: float) -> None:
    """A producer transaction kept open for ``seconds``."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(insert_one(names))
        await asyncio.sleep(seconds)
        await conn.commit()


async def drop_pause(dsn: str, schema: str) -> list[tuple[str, list[float]]]:
    """Each partition's pause (the ingest's turn held), per leg."""
    held: list[float] = []
    detach_and_drop = partitions._detach_and_drop

    async def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await detach_and_drop(*args, **kwargs)
        finally:
            held.append(time.perf_counter() - started)

    partitions._detach_and_drop = timed  # type: ignore[assignment]
    out = []
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for label, open_s in (("short transactions", 0.0), ("one open for 2 s", 2.0)):
            names = await new_outbox(conn, schema, f"pause_{int(open_s)}", PartitionSpec(1_000, 12))
            await load(conn, names, 10_000, 100)
            await keep_ahead(conn, names)
            stop = asyncio.Event()
            producer = asyncio.create_task(produce(dsn, names, stop))
            await asyncio.sleep(0.2)
            holder = asyncio.create_task(hold_open(dsn, names, open_s)) if open_s else None
            await asyncio.sleep(0.1)
            held.clear()
            result = await prune(conn, names, timedelta(hours=1))
            stop.set()
            await producer
            if holder is not None:
                await holder
            assert result.partitions is not None
            print(f"  {label}: dropped {len(result.partitions.dropped)} partitions", file=sys.stderr)
            out.append((label, list(held)))
    partitions._detach_and_drop = detach_and_drop  # type: ignore[assignment]
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("RELAY_BENCH_DSN", DEFAULT_DSN))
    ap.add_argument("--rows", type=int, default=10_000_000, help="done rows retention removes")
    ap.add_argument("--claim-rows", type=int, default=1_000_000, help="done rows beside the pending ones in (b)")
    ap.add_argument("--pending", type=int, default=4_000)
    ap.add_argument("--aggregates", type=int, default=500)
    ap.add_argument("--samples", type=int, default=2_000, help="lookups in (c)")
    ap.add_argument("--claims", type=int, default=150, help="claims measured in (d)")
    ap.add_argument("--only", choices=["retention", "claims", "time-claims", "drop-pause"], action="append")
    args = ap.parse_args()
    only = set(args.only or ["retention", "claims"])
    schema = f"bench_part_{uuid.uuid4().hex[:8]}"

    async def run() -> None:
        async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            if "retention" in only:
                print(f"(a) retention of {args.rows:,} done rows (one run)")
                res = await retention(args.dsn, schema, args.rows)
                print(f"  {'':26} {'wall':>9} {'WAL':>12} {'size before':>13} {'size after':>12}")
                for label, wall, wal_bytes, before, after in res:
                    print(f"  {label:26} {wall:8.1f}s {mib(wal_bytes):>12} {mib(before):>13} {mib(after):>12}")
                (_, w0, b0, _, _), (_, w1, b1, _, _) = res
                print(f"  drop / DELETE: wall {w1 / w0:.4f}x, WAL {b1 / max(b0, 1):.6f}x")
            if "claims" in only:
                print(f"(b) claim latency, {args.claim_rows:,} done + {args.pending:,} pending rows, batch 10")
                res2 = await claims(args.dsn, schema, args.claim_rows, args.pending, args.aggregates)
                for label, times in res2:
                    print(
                        f"  {label:15} claims {len(times):6,}  p50 {statistics.median(times) * 1e3:7.3f} ms"
                        f"  p99 {pct(times, 0.99) * 1e3:7.3f} ms"
                    )
                (_, t0), (_, t1) = res2
                print(
                    f"  30 partitions / plain: p50 {statistics.median(t1) / statistics.median(t0):.2f}x,"
                    f" p99 {pct(t1, 0.99) / pct(t0, 0.99):.2f}x"
                )
                print(f"(c) SELECT ... WHERE id = ANY(10 random ids), {args.samples:,} times")
                res3 = await lookups(args.dsn, schema, args.claim_rows, args.samples)
                base = statistics.median(res3[0][1])
                for label, times in res3:
                    p50 = statistics.median(times)
                    print(
                        f"  {label:15} p50 {p50 * 1e3:7.3f} ms  p99 {pct(times, 0.99) * 1e3:7.3f} ms"
                        f"  ({p50 / base:.2f}x plain)"
                    )
            if "time-claims" in only:
                print(
                    f"(d) claim latency by time, {args.claim_rows:,} done + {args.pending:,} pending rows,"
                    f" batch 10, {args.claims} claims"
                )
                res4 = await time_claims(args.dsn, schema, args.claim_rows, args.pending, args.aggregates, args.claims)
                for label, times, _ in res4:
                    print(
                        f"  {label:26} claims {len(times):4}  p50 {statistics.median(times) * 1e3:7.3f} ms"
                        f"  p99 {pct(times, 0.99) * 1e3:7.3f} ms"
                    )
                (_, t0, _), (_, t1, _) = res4
                print(
                    f"  by time / plain: p50 {statistics.median(t1) / statistics.median(t0):.2f}x,"
                    f" p99 {pct(t1, 0.99) / pct(t0, 0.99):.2f}x"
                )
            if "drop-pause" in only:
                print("(e) ordered numbering paused per dropped partition (the ingest's turn held)")
                for label, times in await drop_pause(args.dsn, schema):
                    print(
                        f"  {label:20} partitions {len(times):3}  p50 {statistics.median(times) * 1e3:8.1f} ms"
                        f"  max {max(times) * 1e3:8.1f} ms  total {sum(times) * 1e3:8.1f} ms"
                    )
        finally:
            async with await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn:
                await conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

    asyncio.run(run())


if __name__ == "__main__":
    main()
