"""Producers the way real services write the outbox, and the order oracle they leave behind.

Every ordering test checks the relay against what the producers themselves observed, never
against a key the relay computes. Three patterns:

* **Locked** (the design reference's precondition, and the default in every test): each
  transaction first writes another table (so PostgreSQL assigns its transaction id early),
  then locks its aggregates' rows with ``SELECT ... FOR UPDATE`` (or takes
  ``pg_advisory_xact_lock`` per aggregate) in sorted order, bumps each aggregate's
  ``version``, inserts the events and commits. The version each transaction read under
  the lock is the aggregate's own history: the oracle. With locks it also equals id order.
* **Insert, then lock**: the event is inserted before the aggregate is locked (outside the
  design reference's precondition, and supported). The oracle is again the version order.
* **Unlocked**: one thread drives several connections that write the same aggregates with
  no lock at all and commit in an order it chooses, often the reverse of their ids. One
  thread issues every COMMIT, so the order the commits returned is exact: the oracle.

Aborted transactions leave nothing in the oracle (their rows never existed).
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.ordering import OrderingMap

if TYPE_CHECKING:
    from tests.conftest import Db

LockKind = Literal["row", "advisory", "insert-then-lock"]


def create_producer_tables(
    dsn: str, names: OutboxNames, aggregates: Iterable[str], *, producer_dsn: str | None = None
) -> None:
    """The producers' own tables beside the outbox: their aggregates (one row each, with a
    version the lock holder bumps) and an unrelated table written first in a transaction.
    Made as ``dsn`` (the owner); with ``producer_dsn``, its role may write them, as a
    service writes its own tables."""
    aggregates_t = sql.Identifier(names.schema, "aggregates")
    audit_t = sql.Identifier(names.schema, "audit")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, version bigint NOT NULL DEFAULT 0)").format(
                aggregates_t
            )
        )
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, note text)").format(audit_t))
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO {} (id) VALUES (%s) ON CONFLICT DO NOTHING").format(aggregates_t),
                [(a,) for a in aggregates],
            )
        if producer_dsn is not None:
            role = sql.Identifier(conninfo_to_dict(producer_dsn)["user"])
            conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE ON {}, {} TO {}").format(aggregates_t, audit_t, role))
            audit_seq = sql.Identifier(names.schema, "audit_id_seq")
            conn.execute(sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(audit_seq, role))


@dataclass
class CommitLog:
    """What the producers committed, as they observed it. Thread-safe.

    ``ordered`` maps aggregate -> [(position, id)], where position orders the aggregate's
    transactions as the producers saw them commit: the version read under the lock, or the
    index of the commit in a single thread's sequence of commits.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rows: dict[str, list[tuple[tuple[int, int], int]]] = field(default_factory=dict)
    committed: int = 0
    aborted: int = 0
    in_doubt: list[tuple[int, list[tuple[str, int]], str]] = field(default_factory=list)

    def record(self, position: int, rows: Iterable[tuple[str, int]]) -> None:
        with self._lock:
            for aggregate_id, oid in rows:
                self._rows.setdefault(aggregate_id, []).append(((position, oid), oid))
            self.committed += 1

    def abort(self) -> None:
        with self._lock:
            self.aborted += 1

    def doubt(self, position: int, rows: Iterable[tuple[str, int]], marker: str) -> None:
        """A COMMIT that failed with a lost connection: it may or may not have committed.
        :func:`resolve_in_doubt` decides later, from the rows on the database: those of
        its ids whose payload carries ``marker``, the transaction's own."""
        with self._lock:
            self.in_doubt.append((position, list(rows), marker))

    def expected(self) -> dict[str, list[int]]:
        """Per aggregate, its event ids in commit order (one transaction's events by id)."""
        with self._lock:
            return {a: [oid for _, oid in sorted(rows)] for a, rows in self._rows.items()}

    def ids(self) -> set[int]:
        return {oid for order in self.expected().values() for oid in order}


def resolve_in_doubt(dsn: str, names: OutboxNames, *logs: CommitLog) -> tuple[int, int]:
    """Settle each log's in-doubt transactions: one committed iff its rows exist (with
    synchronous replication, what the new primary has is what committed). A committed one
    joins the log at the position it was given before its COMMIT. Returns (committed, not).

    Rows are recognised by their transaction's marker in the payload, not by id alone: ids
    a lost transaction took are handed out again by the new primary (nextval is not
    transactional, and its WAL need not have reached the standby), so a row with the same
    id may be another transaction's."""
    counts = [0, 0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for log in logs:
            for position, rows, marker in log.in_doubt:
                ids = [oid for _, oid in rows]
                if not ids:
                    continue
                found = conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE id = ANY(%s) AND payload->>'txn' = %s").format(
                        sql.Identifier(names.schema, names.table)
                    ),
                    (ids, marker),
                ).fetchone()
                n = found[0] if found else 0
                assert n in (0, len(ids)), f"a transaction half there: {n} of ids {ids}"
                if n:
                    log.record(position, rows)
                else:
                    log.abort()
                counts[0 if n else 1] += 1
            log.in_doubt.clear()
    return counts[0], counts[1]


def connect_retrying(dsn: str, *, timeout_s: float = 60.0) -> psycopg.Connection[Any]:
    """A connection, waiting out a failover: until some host of ``dsn`` accepts it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return psycopg.connect(dsn, connect_timeout=2)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _insert_sql(names: OutboxNames) -> sql.Composed:
    return sql.SQL(
        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, %s) RETURNING id"
    ).format(sql.Identifier(names.schema, names.table))


@dataclass
class LockedProducers:
    """``threads`` producers writing ``aggregates`` with the aggregate locked (see module doc)."""

    dsn: str
    names: OutboxNames
    aggregates: list[str]
    log: CommitLog
    threads: int = 4
    lock: LockKind = "row"
    max_aggregates_per_tx: int = 3
    max_events_per_aggregate: int = 3
    event_type: str = "OrderUpdated"
    unordered_type: str | None = None  # also insert an unordered event per transaction
    rollback_share: float = 0.1
    pause_s: float = 0.01  # the longest random sleep after the first write and before commit
    seed: int = 0
    # Survive a failover: a transaction cut by a lost connection is over (aborted, or in
    # doubt if the COMMIT itself was cut: CommitLog.doubt), and the thread reconnects.
    reconnect: bool = False

    def run(self, transactions: int) -> None:
        """Each thread runs ``transactions`` transactions; returns when all are done, and
        raises what any thread raised."""
        errors: list[BaseException] = []

        def thread(rng: random.Random) -> None:
            try:
                self._thread(rng, transactions)
            except BaseException as exc:
                errors.append(exc)

        workers = [
            threading.Thread(target=thread, args=(random.Random(self.seed * 1000 + i),)) for i in range(self.threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]

    def _thread(self, rng: random.Random, transactions: int) -> None:
        conn = connect_retrying(self.dsn) if self.reconnect else psycopg.connect(self.dsn)
        try:
            for t in range(transactions):
                try:
                    self._transaction(conn, rng, t)
                except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
                    # At REPEATABLE READ or SERIALIZABLE a producer retries, as real ones do.
                    conn.rollback()
                    self.log.abort()
                except psycopg.OperationalError:
                    if not self.reconnect or not conn.closed:
                        raise
                    conn = connect_retrying(self.dsn)
        finally:
            conn.close()

    def _transaction(self, conn: psycopg.Connection[Any], rng: random.Random, t: int) -> None:
        insert = _insert_sql(self.names)
        aggregates_t = sql.Identifier(self.names.schema, "aggregates")
        most = min(self.max_aggregates_per_tx, len(self.aggregates))
        chosen = sorted(rng.sample(self.aggregates, k=rng.randint(1, most)))
        # A write elsewhere first: the transaction id is assigned now, long before the
        # aggregate's lock is granted or the transaction commits.
        audit_t = sql.Identifier(self.names.schema, "audit")
        conn.execute(sql.SQL("INSERT INTO {} (note) VALUES (%s)").format(audit_t), (f"tx {t}",))
        time.sleep(rng.uniform(0, self.pause_s))
        rows: list[tuple[str, int]] = []
        # In reconnect mode each transaction marks its rows, so an in-doubt one can be told
        # from another that got the same ids after a failover (resolve_in_doubt).
        marker = uuid.uuid4().hex
        extra = {"txn": marker} if self.reconnect else {}

        def lock() -> None:
            if self.lock == "advisory":
                for a in chosen:
                    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 7))", (a,))
            else:
                conn.execute(
                    sql.SQL("SELECT id FROM {} WHERE id = ANY(%s) ORDER BY id FOR UPDATE").format(aggregates_t),
                    (chosen,),
                )

        def write_events() -> None:
            for a in chosen:
                for e in range(rng.randint(1, self.max_events_per_aggregate)):
                    payload = json.dumps({"tx": t, "event": e, **extra})
                    [(oid,)] = conn.execute(insert, (a, self.event_type, payload)).fetchall()
                    rows.append((a, oid))
                if self.unordered_type:
                    conn.execute(insert, (a, self.unordered_type, "{}"))

        if self.lock == "insert-then-lock":
            write_events()
            lock()
        else:
            lock()
            write_events()
        bump = sql.SQL("UPDATE {} SET version = version + 1 WHERE id = %s RETURNING version").format(aggregates_t)
        versions = {a: conn.execute(bump, (a,)).fetchall()[0][0] for a in chosen}
        time.sleep(rng.uniform(0, self.pause_s))
        if rng.random() < self.rollback_share:
            conn.rollback()
            self.log.abort()
            return
        try:
            conn.commit()
        except psycopg.OperationalError:
            if self.reconnect and conn.closed:
                for a in chosen:
                    self.log.doubt(versions[a], [r for r in rows if r[0] == a], marker)
            raise
        for a in chosen:
            self.log.record(versions[a], [r for r in rows if r[0] == a])


def produce_unlocked(
    dsn: str,
    names: OutboxNames,
    aggregates: list[str],
    log: CommitLog,
    *,
    rounds: int,
    seed: int,
    connections: int = 3,
    event_type: str = "OrderUpdated",
    unordered_type: str | None = "EmailQueued",
    pause_s: tuple[float, float] = (0.0, 0.2),
    on_commit: Callable[[], None] | None = None,
    reconnect: bool = False,
) -> None:
    """Several connections write the same aggregates with no lock and commit in an order
    chosen here, usually against their ids; every commit is issued from this one thread, so
    the order they return in is the commit order the log records. ``reconnect``: survive a
    failover (a round cut by a lost connection is lost, its cut COMMIT in doubt)."""
    rng = random.Random(seed)
    insert = _insert_sql(names)
    positions = itertools.count(1)
    connect = (lambda: connect_retrying(dsn)) if reconnect else (lambda: psycopg.connect(dsn))
    conns = [connect() for _ in range(connections)]
    try:
        for _ in range(rounds):
            try:
                _unlocked_round(
                    conns,
                    rng,
                    insert,
                    aggregates,
                    log,
                    positions,
                    event_type,
                    unordered_type,
                    pause_s,
                    on_commit,
                    reconnect,
                )
            except psycopg.OperationalError:
                # A failover: every transaction of the round still open is lost; the one
                # whose COMMIT was cut is in doubt (recorded by the round). Start afresh.
                if not reconnect:
                    raise
                for conn in conns:
                    conn.close()
                conns = [connect() for _ in range(connections)]
    finally:
        for conn in conns:
            conn.close()


def _unlocked_round(
    conns: list[psycopg.Connection[Any]],
    rng: random.Random,
    insert: sql.Composed,
    aggregates: list[str],
    log: CommitLog,
    positions: Iterator[int],
    event_type: str,
    unordered_type: str | None,
    pause_s: tuple[float, float],
    on_commit: Callable[[], None] | None,
    mark: bool = False,
) -> None:
    """One round of :func:`produce_unlocked`; ``positions`` numbers its COMMITs. ``mark``:
    each transaction's payloads carry its marker (see :func:`resolve_in_doubt`)."""
    markers = [uuid.uuid4().hex for _ in conns]
    chosen = rng.sample(aggregates, k=min(len(aggregates), rng.randint(1, 5)))
    rows: list[list[tuple[str, int]]] = [[] for _ in conns]
    # Interleave the inserts so each transaction holds some lower and some higher ids.
    for _step in range(rng.randint(1, 3)):
        for i, conn in enumerate(conns):
            for a in chosen:
                if rng.random() < 0.7:
                    [(oid,)] = conn.execute(
                        insert, (a, event_type, json.dumps({"by": i, **({"txn": markers[i]} if mark else {})}))
                    ).fetchall()
                    rows[i].append((a, oid))
            if unordered_type:
                conn.execute(insert, (rng.choice(chosen), unordered_type, "{}"))
    order = list(range(len(conns)))
    # Usually the transaction that took the lowest ids commits last.
    order = order[::-1] if rng.random() < 0.7 else rng.sample(order, k=len(order))
    for i in order:
        if rng.random() < 0.1:
            conns[i].rollback()
            log.abort()
            continue
        position = next(positions)
        try:
            conns[i].commit()
        except psycopg.OperationalError:
            # Cut mid-COMMIT: its place in the order is known (this thread issues
            # every COMMIT), whether it happened is not, yet.
            log.doubt(position, rows[i], markers[i])
            raise
        except psycopg.errors.SerializationFailure:
            # Run at SERIALIZABLE, PostgreSQL may abort a commit for a conflict it
            # cannot rule out (its predicate locks are coarse): an application
            # retries such a transaction; here it is one that never happened.
            log.abort()
            continue
        log.record(position, rows[i])
        if on_commit is not None:
            on_commit()
        # Sometimes no pause: both commits land before any relay looks, so they
        # become visible to it together.
        if rng.random() < 0.5:
            time.sleep(rng.uniform(*pause_s))


@dataclass(frozen=True)
class Arrival:
    """One message as a consumer received it, reduced to what the order checks need."""

    outbox_id: int
    aggregate_id: str


def outbox_id(delivery: Any) -> int:
    """The outbox id of a delivery: a consumer's record (``outbox_id``) or a message (``id``)."""
    return int(getattr(delivery, "outbox_id", None) or delivery.id)


def first_deliveries(deliveries: Iterable[Any]) -> list[Any]:
    """Each outbox id's first delivery, in arrival order."""
    seen: set[int] = set()
    first = []
    for d in deliveries:
        if outbox_id(d) not in seen:
            seen.add(outbox_id(d))
            first.append(d)
    return first


def order_violations(expected: dict[str, list[int]], delivered_first: Iterable[Any]) -> list[str]:
    """How the first deliveries disagree with the producers' commit order, per aggregate:
    one line per aggregate whose delivered order is not its commit order."""
    by_aggregate: dict[str, list[int]] = {}
    for d in delivered_first:
        by_aggregate.setdefault(d.aggregate_id, []).append(outbox_id(d))
    problems = []
    for aggregate_id, want in expected.items():
        wanted = set(want)
        got = [i for i in by_aggregate.get(aggregate_id, []) if i in wanted]
        if got != want:
            problems.append(f"{aggregate_id}: delivered {got} but committed {want}")
    return problems


def count_inversions(expected: dict[str, list[int]], delivered_first: Iterable[Any]) -> int:
    """Events first delivered after an event that committed later in the same aggregate."""
    rank = {oid: i for order in expected.values() for i, oid in enumerate(order)}
    latest: dict[str, int] = {}
    inversions = 0
    for d in delivered_first:
        r = rank.get(outbox_id(d))
        if r is None:
            continue
        if r < latest.get(d.aggregate_id, -1):
            inversions += 1
        latest[d.aggregate_id] = max(r, latest.get(d.aggregate_id, -1))
    return inversions


# ---------------------------------------------------------------------------------------
# Orders' lives, seeded in one go (the AWS end-to-end tests drain them)

ORDERING = OrderingMap(default_ordered=False, ordered=("Order*",))
ORDERING_FLAGS = ("--ordering-default", "unordered", "--ordered", "Order*")
# One order's life: the Order* events must reach consumers in this order; the others
# (notifications) may overtake them.
LIFECYCLE = (
    "OrderCreated",
    "OrderItemAdded",
    "OrderItemAdded",
    "CustomerNotified",
    "OrderPriced",
    "OrderPaid",
    "ReceiptEmailed",
    "OrderPacked",
    "OrderShipped",
    "CustomerNotified",
)


async def route_by(dsn: str, names: OutboxNames, ordering: OrderingMap) -> None:
    """Store the ordering map the relay will run with, as `relay migrate --ordered ...`
    does: the database routes each row (ordered or not) when it is inserted, by the map
    stored then."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await store_ordering(conn, names, ordering)


def seed(db: Db, aggregates: int, per_aggregate: int) -> list[dict[str, Any]]:
    """Events interleaved across aggregates, the way concurrent orders would write them."""
    rows = []
    for step in range(per_aggregate):
        for a in range(aggregates):
            event = LIFECYCLE[step % len(LIFECYCLE)]
            rows.append((f"order-{a:03d}", event, {"order": a, "step": step, "event": event}))
    db.insert(rows)
    return db.rows()


def producers_both_ways(
    dsn: str,
    names: OutboxNames,
    *,
    locked_aggregates: list[str],
    unlocked_aggregates: list[str],
    locked_tx: int,
    unlocked_rounds: int,
    seeds: tuple[int, int],
    locked_options: dict[str, Any] | None = None,
    unlocked_options: dict[str, Any] | None = None,
    producer_dsn: str | None = None,
) -> tuple[CommitLog, CommitLog, threading.Thread]:
    """Producers that lock their aggregates (three threads, the design reference's pattern)
    and producers that do not (one thread driving three connections), on aggregates of
    their own, started in the background: their commit logs (the order oracles) and the
    thread to join. ``*_options`` go to :class:`LockedProducers` and :func:`produce_unlocked`.
    ``dsn`` makes the producers' tables (the owner); the producers write as ``producer_dsn``
    (the producer role) when given, else as ``dsn``."""
    writer = producer_dsn or dsn
    create_producer_tables(dsn, names, locked_aggregates, producer_dsn=producer_dsn)
    locked, unlocked = CommitLog(), CommitLog()
    producers = LockedProducers(
        writer, names, locked_aggregates, locked, threads=3, seed=seeds[0], **(locked_options or {})
    )

    def produce() -> None:
        both = [
            threading.Thread(target=producers.run, args=(locked_tx,)),
            threading.Thread(
                target=produce_unlocked,
                args=(writer, names, unlocked_aggregates, unlocked),
                kwargs={"rounds": unlocked_rounds, "seed": seeds[1], **(unlocked_options or {})},
            ),
        ]
        for t in both:
            t.start()
        for t in both:
            t.join()

    thread = threading.Thread(target=produce)
    thread.start()
    return locked, unlocked, thread


# Each kind's share in the destinations' runs with relays killed (a few seconds of writes).
KILLED_RELAYS_RUN = {
    "locked": {"aggregates": 10, "transactions": 40},
    "unlocked": {"aggregates": 6, "transactions": 25},
}


def producers_of_kind(
    owner_dsn: str,
    producer_dsn: str,
    names: OutboxNames,
    kind: str,
    seed: int,
    *,
    aggregates: int,
    transactions: int,
) -> tuple[CommitLog, threading.Thread]:
    """Producers of ``kind`` writing in the background, started: ``locked`` ones (the design
    reference's pattern, three threads of ``transactions`` each, an unordered EmailQueued
    beside each transaction's events) or ``unlocked`` ones (``transactions`` rounds, commits
    against id order), on ``aggregates`` aggregates of their own. Their commit log is the
    order oracle."""
    log = CommitLog()
    if kind == "locked":
        locked = [f"order-L{i}" for i in range(aggregates)]
        create_producer_tables(owner_dsn, names, locked, producer_dsn=producer_dsn)
        producers = LockedProducers(
            producer_dsn, names, locked, log, threads=3, unordered_type="EmailQueued", seed=seed, pause_s=0.02
        )
        thread = threading.Thread(target=producers.run, args=(transactions,))
    else:
        thread = threading.Thread(
            target=produce_unlocked,
            args=(producer_dsn, names, [f"order-U{i}" for i in range(aggregates)], log),
            kwargs={"rounds": transactions, "seed": seed, "pause_s": (0.0, 0.1)},
        )
    thread.start()
    return log, thread


def fleet_producers(
    pg_dsn: str,
    names: OutboxNames,
    seed: int,
    *,
    locked_tx: int,
    unlocked_rounds: int,
    reconnect: bool = False,
    producer_dsn: str | None = None,
) -> tuple[CommitLog, CommitLog, threading.Thread]:
    """The fault scenarios' producers, both ways (:func:`producers_both_ways`), on 12 locked and
    8 unlocked aggregates of their own, writing as ``producer_dsn`` when given; ``reconnect``:
    they survive a lost connection (a failover), each COMMIT it cut recorded as in doubt."""
    return producers_both_ways(
        pg_dsn,
        names,
        locked_aggregates=[f"order-L{i}" for i in range(12)],
        unlocked_aggregates=[f"order-U{i}" for i in range(8)],
        locked_tx=locked_tx,
        unlocked_rounds=unlocked_rounds,
        seeds=(seed, seed),
        locked_options={"unordered_type": "EmailQueued", "pause_s": 0.02, "reconnect": reconnect},
        unlocked_options={"pause_s": (0.0, 0.25), "reconnect": reconnect},
        producer_dsn=producer_dsn,
    )


def merged(*logs: CommitLog) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for log in logs:
        out.update(log.expected())
    return out
