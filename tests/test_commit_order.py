"""Per-aggregate order is commit order, numbered 1, 2, 3, ... (aggregate_seq) without gaps.

The oracle is always what the producers observed (tests/producers.py): the version each
locked transaction read under its aggregate's lock, or the order a single thread issued
its commits in. Delivery order is what the in-memory broker received. Every scenario runs
the design reference's pattern (producers lock the aggregate) first, then the others.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from psycopg.conninfo import make_conninfo

from relay.db.commit_order import CommitOrder, ingest_by_id
from relay.db.dispatch import OutboxStore
from relay.db.grants import Grantee, grant
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.session import open_pool
from relay.db.settings import read_settings, store_ordering
from relay.db.statements import named_queries
from relay.message import Decision, OutboxMessage
from relay.ops import deadletters
from relay.ordering import OrderingMap
from tests.commit_order_helpers import RelayInThread, assert_commit_order, relay_settings, seq_problems
from tests.conftest import Db, Roles
from tests.helpers import set_commit_order
from tests.producers import (
    CommitLog,
    LockedProducers,
    create_producer_tables,
    order_violations,
    produce_unlocked,
)

LEASE = timedelta(seconds=30)


def with_options(dsn: str, **settings: str) -> str:
    """``dsn`` whose sessions start with ``settings``, as a deployment's connection string
    may set them (``options=-c name=value``; a space in a value is escaped for libpq)."""
    escaped = {name: value.replace(" ", "\\ ") for name, value in settings.items()}
    return make_conninfo(dsn, options=" ".join(f"-c {name}={value}" for name, value in escaped.items()))


@pytest.fixture
def aggregates(pg_dsn: str, producer_dsn: str, names: OutboxNames) -> list[str]:
    found = [f"order-{i}" for i in range(12)]
    create_producer_tables(pg_dsn, names, found, producer_dsn=producer_dsn)
    return found


@pytest.mark.parametrize(
    ("lock", "commit_order"),
    [("row", "stamp"), ("advisory", "stamp"), ("insert-then-lock", "stamp"), ("row", "id"), ("advisory", "id")],
)
async def test_locking_producers_are_delivered_in_commit_order(
    pg_dsn: str,
    relay_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    aggregates: list[str],
    lock: Any,
    commit_order: CommitOrder,
) -> None:
    """Under --commit-order id too, for producers that lock before they insert (what that
    mode asks of them; insert-then-lock producers do not qualify)."""
    await set_commit_order(pg_dsn, names, commit_order)
    log = CommitLog()
    producers = LockedProducers(
        producer_dsn, names, aggregates, log, threads=4, lock=lock, unordered_type="EmailQueued", seed=hash(lock) % 1000
    )
    relay = RelayInThread(relay_settings(relay_dsn, names))
    await relay.run_while(lambda: producers.run(40), log.ids)
    assert log.committed > 100 and log.aborted > 0
    if lock != "insert-then-lock":
        # With the lock taken before the insert, the id is drawn under it: id order is
        # commit order, which is what the design reference promises.
        assert all(ids == sorted(ids) for ids in log.expected().values())
    assert_commit_order(log, relay.publisher)


async def test_unlocked_producers_are_delivered_in_commit_order(
    pg_dsn: str, relay_dsn: str, producer_dsn: str, names: OutboxNames, aggregates: list[str]
) -> None:
    log = CommitLog()
    relay = RelayInThread(relay_settings(relay_dsn, names))
    await relay.run_while(
        lambda: produce_unlocked(producer_dsn, names, aggregates, log, rounds=60, seed=3, pause_s=(0.0, 0.05)), log.ids
    )
    expected = log.expected()
    assert any(ids != sorted(ids) for ids in expected.values()), "no commit went against id order: nothing tested"
    assert_commit_order(log, relay.publisher)


def _insert(conn: psycopg.Connection[Any], names: OutboxNames, aggregate_id: str = "a", event: str = "E") -> int:
    [(oid,)] = conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, '{{}}')"
            " RETURNING id"
        ).format(sql.Identifier(names.schema, names.table)),
        (aggregate_id, event),
    ).fetchall()
    return int(oid)


async def deliver(store: OutboxStore) -> list[OutboxMessage]:
    """Claim and finalize as published until nothing is left; what was claimed, in order."""
    out: list[OutboxMessage] = []
    while True:
        claim = await store.claim(owner="w", batch=50, lease=LEASE, max_attempts=3)
        if not claim.messages:
            return out
        out.extend(claim.messages)
        await store.finalize([Decision.published(m) for m in claim.messages])


async def test_commits_the_relay_sees_apart_go_in_the_order_it_saw_them(
    store: OutboxStore, names: OutboxNames, producer_dsn: str
) -> None:
    with psycopg.connect(producer_dsn) as t1, psycopg.connect(producer_dsn) as t2:
        early = _insert(t1, names)  # the lower id, committed last
        late = _insert(t2, names)
        t2.commit()
        [first] = await deliver(store)
        t1.commit()
        [second] = await deliver(store)
    assert (first.id, first.aggregate_seq) == (late, 1)
    assert (second.id, second.aggregate_seq) == (early, 2)


async def test_under_commit_order_id_a_producer_that_does_not_lock_is_reported(
    store: OutboxStore, pg_dsn: str, names: OutboxNames, producer_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The breach the ingest can see: a row that becomes visible after a later id of its
    aggregate was numbered. It is numbered after it (what else), and the relay says so,
    naming the aggregate and both ids."""
    await set_commit_order(pg_dsn, names, "id")
    with psycopg.connect(producer_dsn) as t1, psycopg.connect(producer_dsn) as t2:
        early = _insert(t1, names, "acct-7")  # the lower id, committed last: no lock held
        late = _insert(t2, names, "acct-7")
        t2.commit()
        [first] = await deliver(store)
        t1.commit()
        with caplog.at_level("WARNING", logger="relay.db.dispatch"):
            [second] = await deliver(store)
    assert (first.id, second.id) == (late, early)
    assert [m.aggregate_seq for m in (first, second)] == [1, 2]
    [warning] = [r.getMessage() for r in caplog.records if "commit-order id" in r.getMessage()]
    assert f"acct-7: {early} < {late}" in warning


async def test_under_commit_order_id_rows_that_become_visible_together_go_in_id_order(
    store: OutboxStore, pg_dsn: str, names: OutboxNames, producer_dsn: str
) -> None:
    """Without a stamp, nothing tells the ingest which of two rows visible together
    committed first: it trusts the ids, which is right for producers that lock. The same
    commits as the stamp's test below, numbered by id here."""
    await set_commit_order(pg_dsn, names, "id")
    with psycopg.connect(producer_dsn) as t1, psycopg.connect(producer_dsn) as t2:
        a1 = _insert(t1, names)
        a2 = _insert(t2, names)
        t2.commit()
        t1.commit()
    delivered = await deliver(store)
    assert [(m.id, m.aggregate_seq) for m in delivered] == [(a1, 1), (a2, 2)]


async def test_switching_commit_order_numbers_what_committed_by_the_old_rule_first(
    store: OutboxStore, db: Db, pg_dsn: str, names: OutboxNames, producer_dsn: str
) -> None:
    """Rows committed before a switch are numbered by the rule they were written under,
    in the switch's own transaction, whichever way it goes; the trigger and the index
    follow the mode, and `relay settings show` says which it is."""

    def stamps_and_index() -> tuple[int, str]:
        [(stamps,)] = db.conn.execute(db.names.render("SELECT count(*) FROM {q_commits}")).fetchall()
        [(index,)] = db.conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = %s",
            (names.schema, f"{names.table}_fresh_idx"),
        ).fetchall()
        return int(stamps), str(index)

    # Stamped rows against id order (a producer that does not lock), not yet numbered.
    with psycopg.connect(producer_dsn) as t1, psycopg.connect(producer_dsn) as t2:
        low = _insert(t1, names)
        high = _insert(t2, names)
        t2.commit()
        t1.commit()
    await set_commit_order(pg_dsn, names, "id")
    stamps, index = stamps_and_index()
    assert stamps == 0 and "(id)" in index
    # Written under 'id' (no stamp drawn), then switched back before any relay looked.
    with psycopg.connect(producer_dsn) as t3:
        after = _insert(t3, names)
        t3.commit()
    assert stamps_and_index()[0] == 0, "a stamp was drawn under --commit-order id"
    await set_commit_order(pg_dsn, names, "stamp")
    stamps, index = stamps_and_index()
    assert "(xid, id)" in index
    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        assert (await read_settings(conn, names)).commit_order == "stamp"
    delivered = await deliver(store)
    assert [(m.id, m.aggregate_seq) for m in delivered] == [(high, 1), (low, 2), (after, 3)]


async def test_switching_commit_order_leaves_blocked_skipped_and_leased_rows_as_they_are(
    store: OutboxStore, db: Db, pg_dsn: str, names: OutboxNames
) -> None:
    """What a switch does to rows already past numbering: an aggregate blocked by a dead
    head stays blocked, a skipped row stays skipped (and is not sent), a row in flight
    keeps its lease and its holder's finalize still lands."""
    blocked_head, behind = db.insert([("blocked", "E", {}), ("blocked", "E", {})])
    skipped, after_skip = db.insert([("skipped", "E", {}), ("skipped", "E", {})])
    [in_flight] = db.insert([("leased", "E", {})])
    claim = await store.claim(owner="holder", batch=10, lease=LEASE, max_attempts=3)
    held = {m.id: m for m in claim.messages}
    assert set(held) == {blocked_head, skipped, in_flight}
    # Both heads fail for good; an operator skips one (`relay dead skip`).
    await store.finalize([Decision.dead(held[i], "PermanentError: refused") for i in (blocked_head, skipped)])
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await deadletters.skip(conn, names, [skipped], by="test", reason="not needed")
    await set_commit_order(pg_dsn, names, "id")
    await set_commit_order(pg_dsn, names, "stamp")
    assert db.row(in_flight)["status"] == "processing"
    assert await store.finalize([Decision.published(held[in_flight])]) == set()
    delivered = await deliver(store)
    assert [m.id for m in delivered] == [after_skip]  # nothing behind the dead head, nothing skipped again
    assert (db.row(blocked_head)["status"], db.row(behind)["status"]) == ("dead", "pending")
    assert db.row(skipped)["resolution"] == "skipped"
    assert [db.row(i)["aggregate_seq"] for i in (blocked_head, behind, skipped, after_skip)] == [1, 2, 1, 2]


async def test_commits_that_become_visible_together_go_in_commit_order(
    store: OutboxStore, names: OutboxNames, producer_dsn: str
) -> None:
    """No relay looks between the two commits, so both rows are new to the same ingest.
    The commit stamp, drawn at COMMIT, still tells which committed first."""
    with psycopg.connect(producer_dsn) as t1, psycopg.connect(producer_dsn) as t2, psycopg.connect(producer_dsn) as t3:
        a1 = _insert(t1, names)
        a2 = _insert(t2, names)
        a3 = _insert(t3, names)
        b1 = _insert(t1, names)  # t1 holds the lowest and the highest id
        t3.commit()
        t1.commit()
        t2.commit()
    delivered = await deliver(store)
    assert [(m.id, m.aggregate_seq) for m in delivered] == [(a3, 1), (a1, 2), (b1, 3), (a2, 4)]


@pytest.mark.parametrize("elsewhere", ["same database", "another database"])
async def test_a_transaction_left_open_holds_nothing_back(
    store: OutboxStore, db: Db, pg_dsn: str, elsewhere: str
) -> None:
    other = pg_dsn if elsewhere == "same database" else pg_dsn.rsplit("/", 1)[0] + "/postgres"
    # Neither a producer nor a relay: any other session of the cluster (a batch job, a
    # forgotten psql), here the superuser's, which may connect to the other database too.
    with psycopg.connect(other) as long_tx:
        long_tx.execute("CREATE TEMP TABLE held (x int)")
        long_tx.execute("INSERT INTO held VALUES (1)")  # it has written: it holds a transaction id
        ids = db.insert([("a", "E", {}), ("a", "E", {})])
        assert [m.id for m in await deliver(store)] == ids
        long_tx.rollback()


async def test_an_aborted_producer_transaction_leaves_no_gap(store: OutboxStore, db: Db, producer_dsn: str) -> None:
    [first] = db.insert([("a", "E", {})])
    with psycopg.connect(producer_dsn) as aborted:
        _insert(aborted, db.names)
        _insert(aborted, db.names)
        aborted.rollback()
    [second] = db.insert([("a", "E", {})])
    delivered = await deliver(store)
    assert [(m.id, m.aggregate_seq) for m in delivered] == [(first, 1), (second, 2)]


async def test_one_insert_select_over_many_aggregates(store: OutboxStore, db: Db) -> None:
    db.producer.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', 'agg-' || (g % 50), 'E', jsonb_build_object('g', g) FROM generate_series(1, 200) g"
        ).format(db.table)
    )
    by_aggregate: dict[str, list[tuple[int, int | None]]] = {}
    for m in await deliver(store):
        by_aggregate.setdefault(m.aggregate_id, []).append((m.id, m.aggregate_seq))
    assert len(by_aggregate) == 50
    for got in by_aggregate.values():
        assert [i for i, _ in got] == sorted(i for i, _ in got)  # one transaction: id order
        assert [s for _, s in got] == [1, 2, 3, 4]


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
async def test_producers_at_stricter_isolation_levels(
    producer_dsn: str, relay_dsn: str, names: OutboxNames, aggregates: list[str], isolation: str
) -> None:
    dsn = with_options(producer_dsn, default_transaction_isolation=isolation)
    relay_dsn = with_options(relay_dsn, default_transaction_isolation=isolation)
    for each in (dsn, relay_dsn):
        with psycopg.connect(each) as check:
            [(level,)] = check.execute("SHOW transaction_isolation").fetchall()
            assert level == isolation
    log = CommitLog()
    # Serialization failures are possible only between transactions that conflict; with
    # the aggregate locked first, these do not, and every transaction commits or aborts
    # by the producers' own choice.
    producers = LockedProducers(dsn, names, aggregates, log, threads=3, seed=11)
    unlocked_log = CommitLog()
    relay = RelayInThread(relay_settings(relay_dsn, names))  # the relay's own sessions run READ COMMITTED

    def produce() -> None:
        producers.run(20)
        produce_unlocked(dsn, names, [f"u-{i}" for i in range(5)], unlocked_log, rounds=20, seed=5)

    await relay.run_while(produce, lambda: log.ids() | unlocked_log.ids())
    assert_commit_order(log, relay.publisher)
    assert_commit_order(unlocked_log, relay.publisher)


async def test_two_outboxes_written_in_one_transaction_each_get_their_stamp(
    pg_dsn: str, producer_dsn: str, names: OutboxNames, store: OutboxStore, pool: Any, roles: Roles
) -> None:
    second = OutboxNames(schema=f"t_{uuid.uuid4().hex[:12]}", table="events")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, second)
        await grant(conn, second, [Grantee("producer", roles.producer), Grantee("relay", roles.relay)])
    try:
        other = OutboxStore(pool, second)
        async with pool.connection() as conn:
            await store_ordering(conn, second, OrderingMap())
        with psycopg.connect(roles.producer_dsn) as t1, psycopg.connect(roles.producer_dsn) as t2:
            a_low, b_low = _insert(t1, names), _insert(t1, second)
            a_high, b_high = _insert(t2, names), _insert(t2, second)
            t2.commit()
            t1.commit()
        assert [m.id for m in await deliver(store)] == [a_high, a_low]
        assert [m.id for m in await deliver(other)] == [b_high, b_low]
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(second.schema)))


async def test_rows_written_with_the_triggers_off_are_numbered_by_transaction_then_id(
    store: OutboxStore, db: Db, pg_dsn: str
) -> None:
    """A bulk load under session_replication_role = replica fires no trigger: no route, no
    stamp. Such rows are still numbered, once no stamped transaction waits."""
    # As the superuser: setting session_replication_role takes superuser (or a SET grant on
    # it), which is a DBA's bulk load, not a producer's.
    with psycopg.connect(pg_dsn) as loader:
        loader.execute("SET LOCAL session_replication_role = replica")
        ids = [_insert(loader, db.names) for _ in range(3)]
        loader.commit()
    delivered = await deliver(store)
    assert [(m.id, m.aggregate_seq) for m in delivered] == [(ids[0], 1), (ids[1], 2), (ids[2], 3)]


# -- a property over real connections ---------------------------------------------------

_CONNS = 3
_AGGREGATES = ("a", "b")
_step = st.one_of(
    st.tuples(st.just("insert"), st.integers(0, _CONNS - 1), st.sampled_from(_AGGREGATES)),
    st.tuples(st.just("commit"), st.integers(0, _CONNS - 1), st.just("")),
    st.tuples(st.just("abort"), st.integers(0, _CONNS - 1), st.just("")),
    st.tuples(st.just("relay"), st.integers(0, 2), st.just("")),
)


@pytest.fixture
def producer_conns(producer_dsn: str) -> Iterator[list[psycopg.Connection[Any]]]:
    conns = [psycopg.connect(producer_dsn) for _ in range(_CONNS)]
    yield conns
    for c in conns:
        c.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_step, min_size=1, max_size=40))
async def test_any_interleaving_is_delivered_in_commit_order_without_gaps(
    store: OutboxStore, db: Db, producer_conns: list[psycopg.Connection[Any]], steps: list[tuple[str, int, str]]
) -> None:
    """Random inserts, commits and aborts on several open transactions, with the relay's
    ingest, claim and finalize in between (``relay`` steps: 0 claims and finalizes, 1 only
    claims, 2 finalizes what is claimed). Commit order is the order this test commits in."""
    db.conn.execute(sql.SQL("TRUNCATE {}").format(db.table))
    db.conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(db.names.schema, "outbox_heads")))
    db.conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(db.names.schema, "outbox_commits")))
    log = CommitLog()
    open_rows: list[list[tuple[str, int]]] = [[] for _ in producer_conns]
    position = 0
    claimed: list[OutboxMessage] = []
    delivered: list[OutboxMessage] = []

    async def relay_step(kind: int) -> None:
        if kind in (0, 1):
            claimed.extend((await store.claim(owner="w", batch=10, lease=LEASE, max_attempts=3)).messages)
        if kind in (0, 2) and claimed:
            await store.finalize([Decision.published(m) for m in claimed])
            delivered.extend(claimed)
            claimed.clear()

    for action, i, aggregate_id in [*steps, *(("commit", i, "") for i in range(_CONNS))]:
        conn = producer_conns[i]
        if action == "insert":
            open_rows[i].append((aggregate_id, _insert(conn, db.names, aggregate_id)))
        elif action == "commit":
            conn.commit()
            if open_rows[i]:
                position += 1
                log.record(position, open_rows[i])
            open_rows[i] = []
        elif action == "abort":
            conn.rollback()
            open_rows[i] = []
        else:
            await relay_step(int(i))
    await relay_step(2)
    while True:
        before = len(delivered)
        await relay_step(0)
        if len(delivered) == before:
            break
    assert order_violations(log.expected(), delivered) == []
    assert seq_problems(delivered) == []
    assert {m.id for m in delivered} == log.ids()


@pytest.mark.parametrize("plan", ["custom", "generic"])
@pytest.mark.parametrize(("stamped", "commit_order"), [(True, "stamp"), (False, "stamp"), (False, "id")])
async def test_the_ingest_never_walks_the_history(
    db: Db, pg_dsn: str, relay_dsn: str, stamped: bool, plan: str, commit_order: CommitOrder
) -> None:
    """Its plan reaches the outbox only through index conditions (the fresh index by
    transaction, or by id under --commit-order id, the primary key by id), with or without
    committed transactions waiting, even when the statistics were taken while many rows
    still waited to be numbered."""
    await set_commit_order(pg_dsn, db.names, commit_order)
    ingest = "ingest_by_id" if commit_order == "id" else "ingest"
    queries = {**named_queries(), "ingest_by_id": ingest_by_id(named_queries()["ingest"])}
    db.producer.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)"
            " SELECT 'order', 'x' || (g % 3000), 'E', '{{}}' FROM generate_series(1, 40000) g"
        ).format(db.table)
    )
    # As the owner: ANALYZE takes ownership (autovacuum's own is the superuser's).
    db.conn.execute(sql.SQL("ANALYZE {}").format(db.table))  # as autovacuum might, mid-burst
    async with await psycopg.AsyncConnection.connect(relay_dsn) as aconn:
        await aconn.execute(db.names.render(named_queries()["ingest_lock"]))
        await aconn.execute(db.names.render(named_queries()["ingest"]), {"transactions": 5000})
        await aconn.commit()
    if stamped:
        for i in range(50):
            db.insert([(f"a{i}", "E", {})])
    plans = []
    with psycopg.connect(relay_dsn) as conn:  # EXPLAIN needs the privileges of the statement: the relay's
        conn.execute(db.names.render(named_queries()["ingest_plans"]))  # as OutboxStore._ingest does
        for name in ("ingest_lock", ingest):
            if plan == "custom":
                query = db.names.render(queries[name])
                [(found,)] = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + query, {"transactions": 5000}).fetchall()
            else:  # what a prepared statement may switch to after five executions
                text = queries[name].replace("%(transactions)s", "$1::bigint")
                conn.execute(sql.SQL("PREPARE p_{} AS ").format(sql.SQL(name)) + db.names.render(text))
                conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
                args = "(5000)" if "$1" in text else ""
                [(found,)] = conn.execute(f"EXPLAIN (FORMAT JSON) EXECUTE p_{name}{args}").fetchall()  # type: ignore[call-overload]
            plans.append(found[0]["Plan"])
        conn.rollback()
    walks = [n for p in plans for n in _plan_nodes(p) if n.get("Relation Name") == db.names.table and _walks(n)]
    assert not walks, walks


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _plan_nodes(child)


def _walks(node: dict[str, Any]) -> bool:
    """A scan of the outbox that is not bounded by an index condition."""
    if node["Node Type"] in ("Seq Scan", "Bitmap Heap Scan") and "Recheck Cond" not in node:
        return True
    return node["Node Type"] in ("Index Scan", "Index Only Scan") and (
        "Index Cond" not in node and not str(node.get("Index Name", "")).endswith("fresh_idx")
    )


async def test_the_relays_sessions_run_read_committed_without_jit(relay_dsn: str) -> None:
    """Whatever the database's defaults say: the ingest needs READ COMMITTED, and JIT
    compiling its short statements cost 70 ms each once their estimates grew."""
    hostile = with_options(relay_dsn, default_transaction_isolation="serializable", jit="on")
    pool = await open_pool(hostile, size=1)
    async with pool, pool.connection() as conn, conn.transaction():
        cur = await conn.execute("SELECT current_setting('transaction_isolation'), current_setting('jit')")
        assert await cur.fetchone() == ("read committed", "off")
