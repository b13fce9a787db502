"""A partitioned outbox (relay.db.partitions, migration 0018): created by `relay migrate`, kept
ahead of the producers, pruned by the partition, and run by the same relay, claims, ordering
and operator commands as a plain one.

Each test converts the empty outbox of the `names` fixture (granted to the suite's producer
and relay roles, which the conversion carries over) into one of a few dozen ids per
partition, so that ordinary test volumes cross many partitions.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.partitions import PartitionSpec, keep_ahead
from relay.db.statements import schema_sql
from relay.errors import ConfigError
from relay.retention import prune
from tests.commit_order_helpers import RelayInThread, assert_commit_order, relay_settings
from tests.conftest import Db
from tests.ops_helpers import LEASE, ingest, relay_json, target
from tests.producers import (
    CommitLog,
    LockedProducers,
    create_producer_tables,
    first_deliveries,
    order_violations,
    produce_unlocked,
)
from tests.relay_process import RelayProcess, run_relay, wait_until, wait_until_async

SIZE = 20


async def _partition(pg_dsn: str, names: OutboxNames, size: int = SIZE, ahead: int = 2) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, names, PartitionSpec(size=size, ahead=ahead))


@pytest.fixture
async def parted(pg_dsn: str, names: OutboxNames) -> OutboxNames:
    await _partition(pg_dsn, names)
    return names


def _partitions(db: Db) -> list[str]:
    rows = db.conn.execute(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = %s::regclass ORDER BY c.relname",
        (db.names.qualified,),
    ).fetchall()
    return [r[0] for r in rows]


def _insert(db: Db, n: int, aggregate: str = "a", event_type: str = "EmailQueued") -> None:
    """``n`` rows as the producer, partitions kept ahead between chunks as an elected relay
    keeps them (the fixture's two ahead hold 59 ids)."""
    for start in range(0, n, SIZE):
        db.insert([(aggregate, event_type, {}) for _ in range(min(SIZE, n - start))])
        db.conn.execute(sql.SQL("SELECT {}()").format(sql.Identifier(db.names.schema, "outbox_keep_ahead")))


def _finish(db: Db, where: str = "true", status: str = "done") -> None:
    db.conn.execute(
        sql.SQL(
            "UPDATE {} SET status = %s, done_at = CASE WHEN %s = 'done' THEN now() - interval '1 day' END,"
            " created_at = now() - interval '2 days'"
            " WHERE status = 'pending' AND " + where
        ).format(db.table),
        (status, status),
    )


# ---- the table


def _catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """What the relay relies on of an outbox: columns, checks, indexes and triggers, by name."""
    q = {
        "columns": """SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                             pg_get_expr(d.adbin, d.adrelid), a.attidentity
                        FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                       WHERE a.attrelid = %(t)s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1""",
        "checks": """SELECT conname, pg_get_constraintdef(oid), obj_description(oid, 'pg_constraint')
                       FROM pg_constraint WHERE conrelid = %(t)s::regclass AND contype IN ('c', 'p') ORDER BY 1""",
        "indexes": """SELECT c.relname, replace(pg_get_indexdef(c.oid), 'ONLY ', '')
                        FROM pg_index x JOIN pg_class c ON c.oid = x.indexrelid
                       WHERE x.indrelid = %(t)s::regclass ORDER BY 1""",
        "triggers": """SELECT tgname, tgtype, tgenabled, tgdeferrable, tginitdeferred, tgfoid::regproc::text,
                              pg_get_triggerdef(oid)
                         FROM pg_trigger WHERE tgrelid = %(t)s::regclass AND NOT tgisinternal ORDER BY 1""",
        "grants": "SELECT relacl::text FROM pg_class WHERE oid = %(t)s::regclass",
    }
    out = {}
    for key, text in q.items():
        rows = conn.execute(text, {"t": f"{schema}.outbox"}).fetchall()
        out[key] = [tuple(str(v).replace(schema, "S") for v in r) for r in rows]
    return out


async def test_a_partitioned_outbox_has_the_plain_ones_columns_checks_indexes_triggers_and_grants(
    pg_dsn: str, parted: OutboxNames, db: Db
) -> None:
    """Everything but the two unique indexes on aggregate_id, which each partition carries
    (a partitioned table cannot have them without the partition key)."""
    plain = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(plain)))
        try:
            conn.execute(OutboxNames(plain, "outbox").render(schema_sql()))
            conn.execute(
                sql.SQL("GRANT SELECT ON {} TO PUBLIC; GRANT INSERT (payload) ON {} TO PUBLIC").format(
                    sql.Identifier(plain, "outbox"), sql.Identifier(plain, "outbox")
                )
            )
            theirs = _catalog(conn, plain)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(plain)))
        ours = _catalog(conn, parted.schema)
    assert ours["columns"] == theirs["columns"]
    # NOT VALID on the plain table only so that migration 0005 scanned no old rows; the
    # partitioned table was empty when its check was made, so it is valid (and holds for
    # every insert either way).
    assert ours["checks"] == [tuple(v.replace(" NOT VALID", "") for v in c) for c in theirs["checks"]]
    assert ours["triggers"] == theirs["triggers"]
    unique = {"outbox_one_in_flight_idx", "outbox_aggregate_seq_idx"}
    assert ours["indexes"] == [i for i in theirs["indexes"] if i[0] not in unique]
    # The suite's roles were granted on the plain table the fixture made; the conversion
    # granted the same again (and nothing to PUBLIC, which this comparison table had).
    assert "test_relay_" in ours["grants"][0][0]
    [(may_insert,)] = db.conn.execute(
        "SELECT has_column_privilege(%s, %s, 'payload', 'INSERT')", (db.producer.info.user, parted.qualified)
    ).fetchall()
    assert may_insert
    for part in _partitions(db):
        indexes = {r[0] for r in db.conn.execute("SELECT indexrelid::regclass::text FROM pg_index"
                                                 " WHERE indrelid = %s::regclass AND indisunique",
                                                 (f"{parted.schema}.{part}",)).fetchall()}  # fmt: skip
        assert {f"{parted.schema}.{part}_in_flight", f"{parted.schema}.{part}_seq"} <= indexes


async def test_a_plain_outbox_that_holds_rows_is_refused_and_left_as_it_was(
    pg_dsn: str, names: OutboxNames, db: Db
) -> None:
    db.insert([("a", "OrderPlaced", {})])
    with pytest.raises(ConfigError, match="holds rows, and a table that holds rows cannot be converted online"):
        await _partition(pg_dsn, names)
    assert db.statuses() == {"pending": 1} and not _partitions(db)


async def test_the_partition_size_cannot_change_and_ids_go_on(pg_dsn: str, parted: OutboxNames, db: Db) -> None:
    with pytest.raises(ConfigError, match="cannot change"):
        await _partition(pg_dsn, parted, size=SIZE * 2)
    assert db.insert([("a", "OrderPlaced", {})]) == [1]


# ---- partitions ahead


async def test_keep_ahead_creates_what_the_next_ids_need_once_whoever_runs_it_at_once(
    parted: OutboxNames, db: Db, relay_dsn: str
) -> None:
    """As the relays' role (no DDL: the function runs as the owner), from four sessions at once."""
    before = _partitions(db)
    assert before == ["outbox_p0000", "outbox_p0001", "outbox_p0002"]
    db.insert([(f"a{i}", "OrderPlaced", {}) for i in range(45)])  # ids 1..45: p0002 now holds the next
    conns = [await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) for _ in range(4)]
    try:
        results = await asyncio.gather(*(keep_ahead(c, parted) for c in conns))
    finally:
        for c in conns:
            await c.close()
    made = sorted(p for r in results for p in r.created)
    assert made == ["outbox_p0003", "outbox_p0004"]
    assert all(r.partitioned and r.next_id == 46 and r.covered_to == 100 and r.room == 54 for r in results)
    assert _partitions(db) == [*before, "outbox_p0003", "outbox_p0004"]


async def test_keep_ahead_on_a_plain_outbox_does_nothing(names: OutboxNames, relay_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        assert not (await keep_ahead(conn, names)).partitioned


async def test_an_insert_past_the_partitions_ahead_fails_until_keep_ahead_runs(parted: OutboxNames, db: Db) -> None:
    """What docs/partitioning.md says happens when no relay keeps partitions ahead for too long."""
    db.insert([(f"a{i}", "OrderPlaced", {}) for i in range(3 * SIZE - 1)])  # ids 1..59: every partition full
    with pytest.raises(psycopg.errors.CheckViolation, match="no partition of relation"):
        db.insert([("late", "OrderPlaced", {})])
    async with await psycopg.AsyncConnection.connect(db.conn.info.dsn, autocommit=True) as conn:
        await keep_ahead(conn, parted)
    assert db.insert([("late", "OrderPlaced", {})])


# ---- retention


async def test_prune_drops_finished_partitions_and_says_why_it_keeps_the_others(
    pg_dsn: str, parted: OutboxNames, db: Db
) -> None:
    _insert(db, 4 * SIZE)  # ids 1..80
    _finish(db)
    # p0001 (20..39): two rows still pending. p0002: one dead. p0003: all done. p0004 holds
    # the last id (80).
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'pending', done_at = NULL WHERE id IN (22, 31)").format(db.table))
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'dead', done_at = NULL WHERE id = 45").format(db.table))
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        dry = await prune(conn, parted, timedelta(hours=1), dry_run=True)
        assert dry.partitions is not None and [p.name for p in dry.partitions.dropped] == [
            "outbox_p0000",
            "outbox_p0003",
        ]
        assert _partitions(db)[0] == "outbox_p0000"
        result = await prune(conn, parted, timedelta(hours=1))
    assert result.partitions is not None
    assert [(p.name, p.done) for p in result.partitions.dropped] == [("outbox_p0000", SIZE - 1), ("outbox_p0003", SIZE)]
    why = {k.name: k.why for k in result.partitions.kept}
    assert why["outbox_p0001"] == "2 pending rows (ids 22..31)"
    assert why["outbox_p0002"] == "1 dead row (id 45)"
    assert why["outbox_p0004"] == "holds the last id handed out"
    assert result.done == 2 * SIZE - 1 and len(db.rows()) == 4 * SIZE - (2 * SIZE - 1)
    proc = run_relay("prune", "--dsn", pg_dsn, "--schema", parted.schema, "--older-than", "1h", "--include-dead")
    assert proc.returncode == 0, proc.stderr
    # The dead row is ordered (every type is, by the fixture's map): it blocks its aggregate,
    # and --include-dead lets only unordered ones go.
    assert "outbox_p0002: kept, 1 dead row (id 45)" in proc.stdout
    assert "outbox_p0001: kept, 2 pending rows (ids 22..31)" in proc.stdout


async def test_prune_keeps_what_finished_after_the_cutoff_and_every_later_partition_unread(
    pg_dsn: str, parted: OutboxNames, db: Db
) -> None:
    _insert(db, 2 * SIZE + 5)
    db.conn.execute(sql.SQL("UPDATE {} SET status = 'done', done_at = now()").format(db.table))
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await prune(conn, parted, timedelta(hours=1))
    assert result.partitions is not None and not result.partitions.dropped
    why = {k.name: k.why for k in result.partitions.kept}
    assert why["outbox_p0000"] == "19 rows finished after the cutoff (ids 1..19)"
    assert why["outbox_p0001"] == "newer than the cutoff"


async def test_a_row_that_lands_while_its_partition_is_detached_is_attached_again_not_dropped(
    pg_dsn: str, parted: OutboxNames, db: Db
) -> None:
    """A producer's transaction that drew an id of an old partition commits while prune
    detaches it: DETACH ... CONCURRENTLY waits for it, and the check under the lock sees it."""
    _insert(db, 2 * SIZE)
    _finish(db)
    db.conn.execute(sql.SQL("DELETE FROM {} WHERE id = 7").format(db.table))
    late = psycopg.connect(pg_dsn)
    late.execute(
        sql.SQL(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload) OVERRIDING SYSTEM VALUE"
            " VALUES (7, 'order', 'z', 'EmailQueued', '{{}}')"
        ).format(db.table)
    )
    threading.Timer(0.5, late.commit).start()
    try:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
            result = await prune(conn, parted, timedelta(hours=1))
    finally:
        await asyncio.sleep(0.6)
        late.close()
    assert result.partitions is not None and "outbox_p0000" not in {p.name for p in result.partitions.dropped}
    why = {k.name: k.why for k in result.partitions.kept}
    assert why["outbox_p0000"] == "attached again: 1 unfinished row arrived while it was being detached"
    assert "outbox_p0000" in _partitions(db) and db.row(7)["status"] == "pending"


def _detach_waits_for(conn: psycopg.Connection[Any], names: OutboxNames, what: str) -> bool:
    """Whether a DETACH of a partition of ``names`` waits for a lock on ``what``
    ('virtualxid': transactions using the outbox; 'relation': the partition itself)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'ALTER TABLE%%DETACH%%'"
        " AND strpos(query, %s) > 0 AND wait_event_type = 'Lock' AND wait_event = %s",
        (names.schema, what),
    ).fetchone()
    return bool(row and row[0])


async def test_no_ingest_numbers_past_a_row_that_commits_while_its_partition_is_detached(
    pg_dsn: str, parted: OutboxNames, db: Db, store: OutboxStore
) -> None:
    """The oracle is commit order as this test makes it: row 7 of aggregate z commits into
    partition 0 while prune detaches that partition, then row 41 of z commits. An ingest that
    runs while partition 0 is detached must not consume row 7's commit stamp and number row
    41 first: once the partition is attached again, 7 is z's first and 41 its second."""
    _insert(db, 2 * SIZE)
    _finish(db)
    db.conn.execute(sql.SQL("DELETE FROM {} WHERE id = 7").format(db.table))
    late, blocker, watch = psycopg.connect(pg_dsn), psycopg.connect(pg_dsn), psycopg.connect(pg_dsn, autocommit=True)
    try:
        late.execute(
            sql.SQL(
                "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload) OVERRIDING SYSTEM VALUE"
                " VALUES (7, 'order', 'z', 'OrderPlaced', '{{}}')"
            ).format(db.table)
        )
        # Holds the detach's second step (it locks the partition), which leaves partition 0
        # "detach pending" meanwhile: invisible to the ingest's statements.
        blocker.execute(sql.SQL("SELECT 1 FROM {} LIMIT 0").format(sql.Identifier(parted.schema, "outbox_p0000")))

        async def pruning() -> Any:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
                return await prune(conn, parted, timedelta(hours=1))

        pruned = asyncio.create_task(pruning())
        waits = await wait_until_async(lambda: _detach_waits_for(watch, parted, "virtualxid"), timeout=10)
        assert waits, "the detach never waited for the producer's transaction"
        late.commit()  # row 7
        waits = await wait_until_async(lambda: _detach_waits_for(watch, parted, "relation"), timeout=10)
        assert waits, "the detach never waited for the partition"
        [after] = db.insert([("z", "OrderPlaced", {})])
        for _ in range(3):  # the relays' ingests while partition 0 is detached
            await store.claim(owner="ingest", batch=0, lease=LEASE, max_attempts=3)
        blocker.rollback()
        result = await asyncio.wait_for(pruned, 10)
    finally:
        for c in (late, blocker, watch):
            c.close()
    assert result.partitions is not None and "outbox_p0000" not in {p.name for p in result.partitions.dropped}
    await ingest(store, db, "z")
    await store.claim(owner="ingest", batch=0, lease=LEASE, max_attempts=3)  # numbers what waits behind the head
    assert db.row(7)["ordered"]
    assert (db.row(7)["aggregate_seq"], db.row(after)["aggregate_seq"]) == (1, 2)


async def test_prune_as_a_role_that_does_not_own_the_outbox_drops_nothing_and_says_so(
    parted: OutboxNames, db: Db, relay_dsn: str
) -> None:
    _insert(db, 2 * SIZE)
    _finish(db)
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        result = await prune(conn, parted, timedelta(hours=1))
    assert result.partitions is not None and "owner" in (result.partitions.refused or "")
    assert len(_partitions(db)) == 5


# ---- the relay and the operator commands, unchanged


# --commit-order id is for producers that lock (docs/concepts/ordering.md): unlocked ones
# only under the commit stamp. With them, and prune's cutoff at 0 (shorter than their
# transactions), partitions are detached while transactions commit into them (the test
# above makes that moment happen every time).
@pytest.mark.parametrize(
    ("commit_order", "kind"),
    [
        # Locking producers under the stamp in make test-all (make test keeps its time); the
        # unlocked ones are the harder order.
        pytest.param("stamp", "locked", marks=pytest.mark.extended),
        ("stamp", "unlocked"),
        ("id", "locked"),
    ],
    ids=["stamp-locked", "stamp-unlocked", "id-locked"],
)
async def test_relays_deliver_in_commit_order_while_prune_drops_partitions(
    pg_dsn: str, relay_dsn: str, producer_dsn: str, names: OutboxNames, commit_order: str, kind: str
) -> None:
    """Producers that lock their aggregates (the oracle: what each read under its lock) or
    that do not (one thread commits their transactions in an order of its choosing: the
    oracle) write ordered and unordered events across dozens of partitions; the relay (3
    workers) delivers them, and a prune every 0.1 s drops the partitions that finished
    meanwhile."""
    if commit_order == "id":
        from tests.helpers import set_commit_order

        await set_commit_order(pg_dsn, names, "id")
    await _partition(pg_dsn, names, size=25, ahead=20)
    aggregates = [f"order-{i}" for i in range(8)]
    create_producer_tables(pg_dsn, names, aggregates, producer_dsn=producer_dsn)
    log = CommitLog()
    producers = LockedProducers(producer_dsn, names, aggregates, log, threads=3, unordered_type="EmailQueued", seed=7)
    relay = RelayInThread(relay_settings(relay_dsn, names))
    dropped: list[str] = []
    stop = threading.Event()

    def pruning() -> None:
        async def loop() -> None:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
                while not stop.is_set():
                    await keep_ahead(conn, names)
                    result = await prune(conn, names, timedelta(0))
                    assert result.partitions is not None
                    dropped.extend(p.name for p in result.partitions.dropped)
                    await asyncio.sleep(0.1)

        asyncio.run(loop())

    pruner = threading.Thread(target=pruning)
    pruner.start()
    try:
        if kind == "locked":
            await relay.run_while(lambda: producers.run(30), log.ids)
        else:
            await relay.run_while(
                lambda: produce_unlocked(producer_dsn, names, aggregates, log, rounds=30, seed=7), log.ids
            )
    finally:
        stop.set()
        pruner.join()
    assert log.committed > 50
    assert_commit_order(log, relay.publisher)
    assert dropped, "no partition was dropped while the relay ran: nothing tested"


async def test_operator_commands_work_on_a_partitioned_outbox(
    parted: OutboxNames, db: Db, relay_dsn: str, pg_dsn: str
) -> None:
    db.insert([("agg", "OrderPlaced", {"n": i}) for i in range(3)] + [("u", "EmailQueued", {})] * 30)
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'dead', last_error = 'boom 42' WHERE aggregate_id = 'u' AND id < 10").format(
            db.table
        )
    )
    status = relay_json("status", *target(relay_dsn, db))
    assert status["summary"]["dead"] == 6 and status["summary"]["total_bytes"] > 0
    dead = relay_json("dead", "list", *target(relay_dsn, db))
    assert dead["total"] == 6
    proc = run_relay("dead", "retry", *target(relay_dsn, db), "4", "5")
    assert proc.returncode == 0, proc.stderr
    assert db.row(4)["status"] == "pending"
    relay = RelayProcess("start", "--dsn", relay_dsn, "--schema", parted.schema, "--broker", "log", discard_stdout=True)
    try:
        # Up to the dead row 6, which blocks the rest of aggregate u (ordered, as every type here).
        assert wait_until(lambda: all(r["status"] == "done" for r in db.rows("id <= 5")), timeout=20), relay.tail()
    finally:
        relay.stop()
    explained = relay_json("explain", *target(relay_dsn, db), "agg")
    assert explained
    proc = run_relay("replay", *target(relay_dsn, db), "--broker", "log", "--aggregate", "agg")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count('"aggregate_id": "agg"') >= 3 or "3" in proc.stderr


def test_a_running_relay_makes_the_partitions_producers_need(
    parted: OutboxNames, db: Db, relay_dsn: str, relays: list[RelayProcess]
) -> None:
    # The fixture's partitions hold ids up to 60 (20 each: the current one and two ahead).
    db.insert([("a", "EmailQueued", {}) for _ in range(50)])
    before = _partitions(db)
    # An elected relay of the outbox keeps partitions ahead of the next id (at its start,
    # then every minute): without it, the insert below would find no partition for ids past 60.
    relay = RelayProcess(
        "start", "--dsn", relay_dsn, "--schema", parted.schema, "--broker", "log", "--poll-interval", "200ms"
    )
    relays.append(relay)
    assert wait_until(lambda: len(_partitions(db)) > len(before), timeout=20), relay.tail()
    db.insert([("a", "EmailQueued", {}) for _ in range(30)])  # ids 51..80
    assert wait_until(lambda: db.settled(80), timeout=30), relay.tail()
    assert "partitions ahead: this relay leads" in relay.stderr(), relay.tail()


# ---- partitioned by time (created_at)

HOUR = timedelta(hours=1)


async def _partition_by_time(pg_dsn: str, names: OutboxNames, span: timedelta = HOUR, ahead: int = 2) -> None:
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, names, PartitionSpec(span=span, ahead=ahead))


def _hour(db: Db) -> datetime:
    """The start of the hour holding now(), as keep_ahead aligns it."""
    [(start,)] = db.conn.execute("SELECT date_bin('1 hour', now(), timestamptz '1970-01-01 00:00:00+00')").fetchall()
    assert isinstance(start, datetime)
    return start


def _hourly(db: Db, start: datetime) -> str:
    return f"{db.names.table}_p{start.astimezone(UTC):%Y%m%d%H}"


def _past_partition(db: Db, start: datetime) -> str:
    """The partition an earlier keep_ahead made for the hour ``start`` (keep_ahead itself
    only makes now's and those ahead)."""
    name = _hourly(db, start)
    part, outbox = sql.Identifier(db.names.schema, name), db.table
    db.conn.execute(sql.SQL("CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)").format(part, outbox))
    db.conn.execute(
        sql.SQL("ALTER TABLE {} ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
            outbox, part, sql.Literal(start), sql.Literal(start + HOUR)
        )
    )
    return name


def _insert_at(db: Db, rows: list[tuple[str, datetime]]) -> list[int]:
    """One transaction of ordered rows (aggregate_id, created_at), as the owner (producers
    cannot choose created_at): rows created in past hours."""
    with db.conn.transaction():
        return [
            db.conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, created_at)"
                    " VALUES ('order', %s, 'OrderPlaced', '{{}}', %s) RETURNING id"
                ).format(db.table),
                (aggregate, at),
            ).fetchall()[0][0]
            for aggregate, at in rows
        ]


async def test_a_time_partitioned_outbox_has_now_and_the_partitions_ahead_and_a_primary_key_with_created_at(
    pg_dsn: str, names: OutboxNames, db: Db, relay_dsn: str
) -> None:
    await _partition_by_time(pg_dsn, names, span=timedelta(days=1), ahead=3)
    [(day,)] = db.conn.execute("SELECT date_bin('1 day', now(), timestamptz '1970-01-01 00:00:00+00')").fetchall()
    days = [f"outbox_p{(day + timedelta(days=n)).astimezone(UTC):%Y%m%d}" for n in range(4)]
    assert _partitions(db) == days
    [(pkey,)] = db.conn.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass AND contype = 'p'",
        (names.qualified,),
    ).fetchall()
    assert pkey == "PRIMARY KEY (id, created_at)"
    assert db.insert([("a", "OrderPlaced", {}), ("b", "OrderPlaced", {})]) == [1, 2]
    async with await psycopg.AsyncConnection.connect(relay_dsn, autocommit=True) as conn:
        again = await keep_ahead(conn, names)  # as the relays' role: nothing missing
    assert again.partitioned and again.created == () and again.covered_until == day + timedelta(days=4)
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", names.schema, "--partition-by", "time",
                     "--partition-interval", "1d", "--partitions-ahead", "5")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _partitions(db) == days + [f"outbox_p{(day + timedelta(days=n)).astimezone(UTC):%Y%m%d}" for n in (4, 5)]


async def test_the_partition_interval_and_key_cannot_change(pg_dsn: str, names: OutboxNames, db: Db) -> None:
    await _partition_by_time(pg_dsn, names)
    with pytest.raises(ConfigError, match=r"partitioned by time, 1h per partition; --partition-interval 1d cannot"):
        await _partition_by_time(pg_dsn, names, span=timedelta(days=1))
    with pytest.raises(ConfigError, match="--partition-by id cannot change that"):
        await _partition(pg_dsn, names)
    proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", names.schema, "--partition-by", "time",
                     "--partition-interval", "2h")  # fmt: skip
    assert proc.returncode != 0 and "--partition-interval 2h cannot change that" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert db.insert([("a", "OrderPlaced", {})]) == [1]


@pytest.mark.parametrize("span", [timedelta(minutes=30), timedelta(minutes=90), timedelta(days=400)])
def test_a_partition_interval_is_whole_hours_up_to_366_days(span: timedelta) -> None:
    with pytest.raises(ConfigError, match=r"--partition-interval .*: a whole number of hours, from 1h to 366d"):
        PartitionSpec(span=span)


async def test_a_relay_delivers_in_commit_order_across_time_partitions(
    pg_dsn: str, relay_dsn: str, names: OutboxNames, db: Db
) -> None:
    """Transactions whose rows land in three past hours and the current one, in turn: the
    relay delivers each aggregate's rows in commit order whatever partition holds them."""
    await _partition_by_time(pg_dsn, names)
    hour = _hour(db)
    for n in (3, 2, 1):
        _past_partition(db, hour - n * HOUR)
    relay = RelayInThread(relay_settings(relay_dsn, names))
    expected: dict[str, list[int]] = {}

    def produce() -> None:
        for t in range(12):
            at = hour - (t % 4) * HOUR + timedelta(minutes=t)
            rows = [(f"order-{(t + i) % 3}", at) for i in range(4)]
            for (aggregate, _), id_ in zip(rows, _insert_at(db, rows), strict=True):
                expected.setdefault(aggregate, []).append(id_)

    await relay.run_while(produce, lambda: {i for ids in expected.values() for i in ids})
    counts = db.conn.execute(
        sql.SQL("SELECT tableoid::regclass::text, count(*) FROM {} GROUP BY 1").format(db.table)
    ).fetchall()
    assert len(counts) == 4, counts
    first = [m for m in first_deliveries(relay.publisher.delivered) if m.ordered]
    assert len(first) == 48 and not order_violations(expected, first)


async def test_prune_drops_a_finished_time_partition_and_keeps_one_with_a_pending_row(
    pg_dsn: str, names: OutboxNames, db: Db
) -> None:
    await _partition_by_time(pg_dsn, names)
    hour = _hour(db)
    old, older = _past_partition(db, hour - 2 * HOUR), _past_partition(db, hour - 3 * HOUR)
    _insert_at(db, [("a", hour - 3 * HOUR + timedelta(minutes=5 + i)) for i in range(5)])
    ids = _insert_at(db, [("b", hour - 2 * HOUR + timedelta(minutes=5 + i)) for i in range(5)])
    db.insert([("c", "OrderPlaced", {})])  # now: the current partition
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'done', done_at = now() - interval '1 day' WHERE id <> %s").format(db.table),
        (ids[2],),
    )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await prune(conn, names, timedelta(minutes=30))
    assert result.partitions is not None
    assert [(p.name, p.done) for p in result.partitions.dropped] == [(older, 5)]
    why = {k.name: k.why for k in result.partitions.kept}
    assert why[old] == f"1 pending row (id {ids[2]})"
    assert why[_hourly(db, hour)] == "holds now"
    assert why[_hourly(db, hour + HOUR)] == why[_hourly(db, hour + 2 * HOUR)] == "ahead of now"
    assert older not in _partitions(db) and len(db.rows()) == 6


async def test_a_time_partition_an_interrupted_prune_left_detached_is_dropped_or_attached_again_at_its_hour(
    pg_dsn: str, names: OutboxNames, db: Db
) -> None:
    await _partition_by_time(pg_dsn, names)
    hour = _hour(db)
    done, busy = _past_partition(db, hour - 3 * HOUR), _past_partition(db, hour - 2 * HOUR)
    _insert_at(db, [("a", hour - 3 * HOUR + timedelta(minutes=1))])
    [pending] = _insert_at(db, [("b", hour - 2 * HOUR + timedelta(minutes=1))])
    db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'done', done_at = now() - interval '1 day' WHERE id <> %s").format(db.table),
        (pending,),
    )
    for name in (done, busy):
        db.conn.execute(
            sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(db.table, sql.Identifier(names.schema, name))
        )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        result = await prune(conn, names, timedelta(minutes=30))
    assert result.partitions is not None and [p.name for p in result.partitions.dropped] == [done]
    assert busy in _partitions(db) and db.row(pending)["status"] == "pending"
    # Attached again at its own hour: its first and last instants land in it.
    for at in (hour - 2 * HOUR, hour - HOUR - timedelta(microseconds=1)):
        [id_] = _insert_at(db, [("c", at)])
        [(where,)] = db.conn.execute(
            sql.SQL("SELECT tableoid::regclass::text FROM {} WHERE id = %s").format(db.table), (id_,)
        ).fetchall()
        assert where == f"{names.schema}.{busy}"
