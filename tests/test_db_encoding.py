"""The relay on databases whose encoding is not UTF8: SQL_ASCII (bytes stored unchecked,
nothing converted) and LATIN1 / WIN1252 (converted by the server). Each test creates a
database of its own with that encoding, migrated by the superuser with the suite's producer
and relay roles granted there (the roles are the cluster's; the grants are per database),
and drops it afterwards; the relay runs as a real process (`relay start --broker log`, the
operator commands) as the relay role, and the producers write as the producer role."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.db.session import open_pool
from relay.db.text import not_utf8, storable
from relay.decide import describe_text
from relay.message import Decision
from tests.conftest import Roles, dsn_as
from tests.relay_process import RelayProcess, relay_env, run_relay, wait_until

OUTBOX = sql.Identifier("public", "outbox")


@dataclass(frozen=True)
class Database:
    """A database of the test's own, reached as each of the three roles."""

    owner: str  # the superuser's DSN: it made the database, migrated it, and inspects it
    producer: str
    relay: str


MakeDatabase = Callable[[str], Database]


@pytest.fixture
def make_database(pg_dsn: str, roles: Roles) -> Iterator[MakeDatabase]:
    """``make_database("SQL_ASCII")``: a new database of that encoding, its default outbox
    migrated by `relay migrate --grant-producer --grant-relay` (the suite's two roles)."""
    created: list[str] = []

    def make(encoding: str) -> Database:
        name = f"relay_enc_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} ENCODING {} LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0").format(
                    sql.Identifier(name), sql.Literal(encoding)
                )
            )
        created.append(name)
        owner = conninfo.make_conninfo(pg_dsn, dbname=name)
        grants = ["--grant-producer", roles.producer, "--grant-relay", roles.relay]
        assert_clean(run_relay("migrate", "--dsn", owner, *grants))
        return Database(owner, dsn_as(owner, roles.producer), dsn_as(owner, roles.relay))

    yield make
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in created:
            # The roles' privileges in it go with it: `roles` can drop them at the end.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def insert(conn: psycopg.Connection[Any], aggregate_id: str, event_type: str, payload: object) -> int:
    """A producer's INSERT; the payload as JSON text with its characters as they are (a
    \\u escape of a non-ASCII character is refused by jsonb in a database that is not UTF8)."""
    [(oid,)] = conn.execute(
        sql.SQL(
            "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', %s, %s, %s)"
            " RETURNING id"
        ).format(OUTBOX),
        (aggregate_id, event_type, json.dumps(payload, ensure_ascii=False)),
    ).fetchall()
    return int(oid)


def rows(dsn: str) -> dict[int, tuple[str, str | None]]:
    """id -> (status, last_error), read back as UTF-8 whatever the database's encoding."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = conn.execute(
            sql.SQL("SELECT id, convert_to(status, 'UTF8'), convert_to(last_error, 'UTF8') FROM {}").format(OUTBOX)
        ).fetchall()
    return {i: (bytes(s).decode(), None if e is None else bytes(e).decode("utf-8", "replace")) for i, s, e in found}


def deliver(db: Database, expected: int) -> tuple[list[dict[str, Any]], str]:
    """Run `relay start --broker log` as the relay role until ``expected`` rows are
    finished; its JSON lines and stderr."""

    def finished() -> bool:
        return sum(status in ("done", "dead") for status, _ in rows(db.owner).values()) >= expected

    env = relay_env(RELAY_DSN=db.relay)
    with RelayProcess("start", "--broker", "log", "--poll-interval", "100ms", env=env) as proc:
        try:
            wait_until(lambda: not proc.running() or finished(), timeout=30)
        finally:
            proc.stop()
        out, err = proc.stdout(), proc.stderr()
    assert proc.returncode == 0, err
    assert "Traceback" not in err, err
    return [json.loads(line) for line in out.splitlines()], err


def assert_clean(proc: Any) -> str:
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return str(proc.stdout)


def test_sql_ascii_delivers_utf8_text_and_sends_rows_that_are_not_utf8_to_dead_alone(
    make_database: MakeDatabase,
) -> None:
    db = make_database("SQL_ASCII")
    with psycopg.connect(db.producer, autocommit=True) as conn:  # an application writing UTF-8
        good = {
            insert(conn, "Zoë", "CaféOpened", {"who": "Zoë", "price": "€5"}): ("Zoë", "CaféOpened", "€5"),
            insert(conn, "order-1", "OrderPlaced", {"who": "ascii"}): ("order-1", "OrderPlaced", None),
        }
    # A legacy application writing LATIN1 bytes: SQL_ASCII stores them unchecked.
    with psycopg.connect(db.producer, autocommit=True, client_encoding="LATIN1") as legacy:
        bad_aggregate = insert(legacy, "Zoé", "OrderPlaced", {})
        bad_event_type = insert(legacy, "order-2", "CréditNoted", {})
        bad_payload = insert(legacy, "order-3", "OrderPlaced", {"who": "Zoé"})
    with psycopg.connect(db.producer, autocommit=True) as conn:
        good[insert(conn, "order-4", "OrderPlaced", {"n": 4})] = ("order-4", "OrderPlaced", None)

    delivered, err = deliver(db, expected=6)

    assert sorted(line["outbox_id"] for line in delivered) == sorted(good)
    for line in delivered:
        aggregate_id, event_type, price = good[line["outbox_id"]]
        assert (line["aggregate_id"], line["event_type"]) == (aggregate_id, event_type)
        if price:
            assert line["payload"] == {"who": "Zoë", "price": price}
    found = rows(db.owner)
    assert {i: s for i, (s, _) in found.items()} == {
        **dict.fromkeys(good, "done"),
        **dict.fromkeys((bad_aggregate, bad_event_type, bad_payload), "dead"),
    }
    assert "aggregate_id is not valid UTF-8 (byte 0xe9 at offset 2)" in str(found[bad_aggregate][1])
    assert "event_type is not valid UTF-8 (byte 0xe9 at offset 2)" in str(found[bad_event_type][1])
    assert "payload is not valid UTF-8" in str(found[bad_payload][1])
    assert "encoding is SQL_ASCII" in err

    status = assert_clean(run_relay("status", "--dsn", db.relay, "--by-event-type"))
    assert "dead" in status
    assert_clean(run_relay("dead", "list", "--dsn", db.relay))
    page = json.loads(assert_clean(run_relay("dead", "list", "--dsn", db.relay, "--json")))
    listed = {m["id"]: m for m in page["messages"]}
    assert sorted(listed) == sorted((bad_aggregate, bad_event_type, bad_payload))
    # Bytes that are not UTF-8 are shown, escaped, rather than failing the listing.
    assert listed[bad_aggregate]["aggregate_id"] == "Zo\\xe9"
    assert listed[bad_event_type]["event_type"] == "Cr\\xe9ditNoted"
    assert_clean(run_relay("dead", "list", "--dsn", db.relay, "--group"))
    explained = json.loads(assert_clean(run_relay("explain", "--dsn", db.relay, "order-2", "--json")))
    assert "Cr\\\\xe9ditNoted" in json.dumps(explained)


@pytest.mark.parametrize(
    ("encoding", "who", "price"),
    [("LATIN1", "Zoë", "5 £"), ("WIN1252", "Zoë", "€5")],
)
def test_a_database_in_a_single_byte_encoding_delivers_its_text_as_utf8(
    make_database: MakeDatabase, encoding: str, who: str, price: str
) -> None:
    db = make_database(encoding)
    with psycopg.connect(db.producer, autocommit=True, client_encoding="UTF8") as conn:
        ids = [insert(conn, who, "CaféOpened", {"who": who, "price": price}) for _ in range(3)]

    delivered, _ = deliver(db, expected=3)

    assert sorted(line["outbox_id"] for line in delivered) == ids
    for line in delivered:
        assert (line["aggregate_id"], line["event_type"]) == (who, "CaféOpened")
        assert line["payload"] == {"who": who, "price": price}
    status = assert_clean(run_relay("status", "--dsn", db.relay, "--by-event-type", "--json"))
    assert json.loads(status)
    assert_clean(run_relay("dead", "list", "--dsn", db.relay))


async def test_an_error_the_database_encoding_cannot_hold_is_stored_escaped(make_database: MakeDatabase) -> None:
    """An outcome's error can hold characters a LATIN1 database has no room for (the "…" of
    a cut message, a euro sign in a broker's reply); the write of the batch must not fail."""
    db = make_database("LATIN1")
    with psycopg.connect(db.producer, autocommit=True, client_encoding="UTF8") as conn:
        oid = insert(conn, "Zoë", "CaféOpened", {})
    pool = await open_pool(db.relay, size=1)
    try:
        store = OutboxStore(pool, OutboxNames())  # migrate stored the default map: all ordered
        claim = await store.claim(owner="test", batch=10, lease=timedelta(seconds=30), max_attempts=3)
        [message] = claim.messages
        error = describe_text(f"refused for {message.aggregate_id}: price €5 " + "x" * 2000)
        assert await store.finalize([Decision.dead(message, error)]) == set()
    finally:
        await pool.close()
    status, stored = rows(db.owner)[oid]
    assert status == "dead"
    assert stored is not None
    assert stored.startswith("refused for Zoë: price \\u20ac5 xxx")
    assert stored.endswith("x\\u2026")


async def test_sql_ascii_claim_keeps_a_row_that_is_not_utf8_apart_with_its_bytes(make_database: MakeDatabase) -> None:
    db = make_database("SQL_ASCII")
    with psycopg.connect(db.producer, autocommit=True, client_encoding="LATIN1") as legacy:
        bad = insert(legacy, "order-1", "CréditNoted", {"who": "Zoé"})
    with psycopg.connect(db.producer, autocommit=True) as conn:
        good = insert(conn, "order-2", "CaféOpened", {"who": "Zoë"})
    pool = await open_pool(db.relay, size=1)
    try:
        store = OutboxStore(pool, OutboxNames())  # migrate stored the default map: all ordered
        claim = await store.claim(owner="test", batch=10, lease=timedelta(seconds=30), max_attempts=3)
        assert [(m.id, m.event_type, m.payload()) for m in claim.messages] == [(good, "CaféOpened", {"who": "Zoë"})]
        [unreadable] = claim.unreadable
        assert (unreadable.message.id, unreadable.message.event_type) == (bad, "Cr\\xe9ditNoted")
        assert unreadable.message.body == '{"who": "Zoé"}'.encode("latin-1")  # the bytes as stored
        assert unreadable.reason.startswith("event_type is not valid UTF-8 (byte 0xe9 at offset 2)")
        # A crash before the row was finalized: its lease expires and the reaper reports it, readably.
        with psycopg.connect(db.owner, autocommit=True) as conn:
            conn.execute(sql.SQL("UPDATE {} SET lease_until = now() - interval '1 second'").format(OUTBOX))
        again = await store.claim(owner="test", batch=10, lease=timedelta(seconds=30), max_attempts=3)
        assert sorted((r.id, r.event_type) for r in again.reaped) == [(bad, "Cr\\xe9ditNoted"), (good, "CaféOpened")]
    finally:
        await pool.close()


def test_not_utf8_names_the_first_byte_and_its_offset() -> None:
    raw = "Zoé €".encode("latin-1", "replace")
    assert not_utf8(raw.decode("utf-8", "surrogateescape")) == "byte 0xe9 at offset 2"
    assert not_utf8("Zoë €") is None
    assert not_utf8("plain") is None


def test_storable_keeps_what_the_encoding_holds() -> None:
    assert storable("Zoë €…", "UTF8") == "Zoë €…"
    assert storable("Zoë €…", "LATIN1") == "Zoë \\u20ac\\u2026"
    assert storable("Zoë €…", "WIN1252") == "Zoë €…"
    assert storable("Zoë", "MULE_INTERNAL") == "Zo\\xeb"
    assert storable("Zo\udce9", "SQL_ASCII") == "Zo\\udce9"
