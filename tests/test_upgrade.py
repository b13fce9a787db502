"""`relay migrate` from the schema before aggregate_seq (migrations 0001-0003), in place,
with rows in every status; and relays older than migration 0004 refused afterwards."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay.db.dispatch import OutboxStore
from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.settings import store_ordering
from relay.message import Decision, OutboxMessage
from relay.ordering import OrderingMap
from tests.relay_process import run_relay

LEASE = timedelta(seconds=30)


@pytest.fixture
def old_names(outbox_at: Callable[[int], OutboxNames]) -> OutboxNames:
    """An outbox at migration 0003, as the release before aggregate_seq left it."""
    return outbox_at(3)


def _table(names: OutboxNames, suffix: str = "") -> sql.Identifier:
    return sql.Identifier(names.schema, names.table + suffix)


def _insert(
    conn: psycopg.Connection[Any], names: OutboxNames, aggregate_id: str, event_type: str = "OrderPlaced"
) -> int:
    [(oid,)] = conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, '{{}}')"
            " RETURNING id"
        ).format(_table(names)),
        (aggregate_id, event_type),
    ).fetchall()
    return int(oid)


async def test_upgrade_numbers_unfinished_rows_in_their_old_order_and_loses_nothing(
    pg_dsn: str, old_names: OutboxNames
) -> None:
    names = old_names
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {} SET ord_default = false, unord_names = '{{}}', ord_patterns = %s").format(
                _table(names, "_settings")
            ),
            (["^Order.*$"],),
        )
        # 'x': a row that commits before a lower id (the old order is (xid, id))
        with psycopg.connect(pg_dsn) as t1, psycopg.connect(pg_dsn) as t2:
            t1.execute("SELECT pg_current_xact_id()")
            x_late_id = _insert(t2, names, "x")
            t2.commit()
            x_early_xid = _insert(t1, names, "x")  # higher id, lower xid
            t1.commit()
        ids = {
            "done": _insert(conn, names, "a"),
            "a_processing": _insert(conn, names, "a"),
            "a_pending": _insert(conn, names, "a"),
            "b_dead": _insert(conn, names, "b"),
            "b_behind": _insert(conn, names, "b"),
            "c_pending": _insert(conn, names, "c"),
            "unordered": _insert(conn, names, "a", "EmailSent"),
        }
        t = _table(names)
        conn.execute(sql.SQL("UPDATE {} SET status = 'done', done_at = now() WHERE id = %s").format(t), (ids["done"],))
        conn.execute(
            sql.SQL(
                "UPDATE {} SET status = 'processing', lease_until = now() + interval '1 minute',"
                " lease_version = 4, attempts = 1, lease_owner = 'old-relay' WHERE id = %s"
            ).format(t),
            (ids["a_processing"],),
        )
        conn.execute(
            sql.SQL("UPDATE {} SET status = 'dead', last_error = 'rejected', attempts = 3 WHERE id = %s").format(t),
            (ids["b_dead"],),
        )
        [(x_first,)] = conn.execute(
            sql.SQL("SELECT id FROM {} WHERE aggregate_id = 'x' ORDER BY xid, id LIMIT 1").format(t)
        ).fetchall()
        assert x_first == x_early_xid != x_late_id  # the old order differs from id order here
        # Heads as the old ingest left them: some set, one stale (its row finished since).
        conn.execute(
            sql.SQL("INSERT INTO {} (aggregate_id, head_id, head_xid) VALUES ('a', %s, '1'), ('gone', %s, '1')").format(
                _table(names, "_heads")
            ),
            (ids["a_processing"], ids["done"]),
        )
        before = {r[0]: r[1:] for r in conn.execute(sql.SQL("SELECT id, status, attempts FROM {}").format(t))}

        proc = run_relay("migrate", "--dsn", pg_dsn, "--schema", names.schema)
        assert proc.returncode == 0, proc.stderr
        assert "applied 0004_aggregate_seq" in proc.stdout

        after = {r[0]: r[1:] for r in conn.execute(sql.SQL("SELECT id, status, attempts FROM {}").format(t))}
        assert after == before  # nothing lost, no status or attempt changed
        seqs = dict(conn.execute(sql.SQL("SELECT id, aggregate_seq FROM {}").format(t)).fetchall())
        assert seqs[ids["done"]] is None and seqs[ids["unordered"]] is None
        assert (seqs[ids["a_processing"]], seqs[ids["a_pending"]]) == (1, 2)
        assert (seqs[ids["b_dead"]], seqs[ids["b_behind"]], seqs[ids["c_pending"]]) == (1, 2, 1)
        assert (seqs[x_early_xid], seqs[x_late_id]) == (1, 2)  # the old order, kept
        heads = {
            r[0]: r[1:]
            for r in conn.execute(
                sql.SQL("SELECT aggregate_id, head_id, ready_at IS NOT NULL, last_seq FROM {}").format(
                    _table(names, "_heads")
                )
            )
        }
        assert heads["a"] == (ids["a_processing"], False, 2)  # still in flight
        assert heads["b"] == (ids["b_dead"], False, 2)  # still blocked
        assert heads["c"] == (ids["c_pending"], True, 1)
        assert heads["x"] == (x_early_xid, True, 2)
        assert heads["gone"] == (None, False, 0)

    # The old relay's in-flight head finishes under its old lease (the finalize statement
    # is the same in both releases); then everything flows.
    async with AsyncConnectionPool(pg_dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        async with pool.connection() as conn:
            await store_ordering(conn, names, OrderingMap(default_ordered=False, ordered=("Order*",)))
        store = OutboxStore(pool, names)
        in_flight = (await store.claim(owner="new", batch=10, lease=LEASE, max_attempts=3)).messages
        assert ids["a_processing"] not in {m.id for m in in_flight}
        await store.finalize([Decision.published(m) for m in in_flight])
        old_claim = OutboxMessage(
            id=ids["a_processing"], aggregate_type="order", aggregate_id="a", event_type="OrderPlaced",
            body=b"{}", attempt=1, lease_version=4, ordered=True,
        )  # fmt: skip
        assert await store.finalize([Decision.published(old_claim)]) == set()
        delivered = list(in_flight)
        while True:
            batch = (await store.claim(owner="new", batch=10, lease=LEASE, max_attempts=3)).messages
            if not batch:
                break
            delivered += batch
            await store.finalize([Decision.published(m) for m in batch])
    got = [(m.aggregate_id, m.id, m.aggregate_seq) for m in delivered if m.ordered]
    assert sorted(got) == sorted(
        [("a", ids["a_pending"], 2), ("c", ids["c_pending"], 1), ("x", x_early_xid, 1), ("x", x_late_id, 2)]
    )
    assert [i for a, i, _ in got if a == "x"] == [x_early_xid, x_late_id]
    assert ids["unordered"] in {m.id for m in delivered}
    assert ids["b_behind"] not in {m.id for m in delivered}  # behind its dead head, as before


async def test_relays_older_than_the_upgrade_are_refused_before_they_change_anything(
    pg_dsn: str, old_names: OutboxNames
) -> None:
    names = old_names
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        [oid] = [_insert(conn, names, "a")]
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as aconn:
            await migrate(aconn, names)
        heads_before = conn.execute(sql.SQL("SELECT * FROM {}").format(_table(names, "_heads"))).fetchall()
        # What a relay of the release before 0004 runs: at start, it stores its settings
        # with the commit-order guard; on every claim, its ingest advances the cursor.
        with pytest.raises(psycopg.errors.RaiseException, match="upgraded to migration 0004") as started:
            conn.execute(sql.SQL("UPDATE {} SET commit_order_guard = true").format(_table(names, "_settings")))
        assert "this relay is older and must be upgraded" in str(started.value)
        with pytest.raises(psycopg.errors.RaiseException, match="upgraded to migration 0004"):
            conn.execute(
                sql.SQL(
                    "WITH offered AS (INSERT INTO {} (aggregate_id, head_id, head_xid, ready_at)"
                    " VALUES ('a', %s, '1', now()) ON CONFLICT (aggregate_id) DO UPDATE SET head_id = excluded.head_id"
                    " RETURNING 1) UPDATE {} SET ingested_xid = '5' RETURNING (SELECT count(*) FROM offered)"
                ).format(_table(names, "_heads"), _table(names, "_cursor")),
                (oid,),
            )
        assert conn.execute(sql.SQL("SELECT * FROM {}").format(_table(names, "_heads"))).fetchall() == heads_before
