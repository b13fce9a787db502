"""Several outboxes in one relay process ([[outboxes]], relay.fleet), against real
PostgreSQL (two databases, several schemas) and RabbitMQ.

The oracles are the producers' own commit logs (locking and unlocked producers) and what
each outbox's queue received; isolation is judged by what the other outboxes deliver
while one outbox's database is gone, read-only, locked, or its grants are revoked.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from relay import Relay
from relay.db.grants import GRANTS_LOCK, Grantee, statements
from relay.db.names import OutboxNames
from relay.db.statements import schema_sql
from relay.testing import InMemoryPublisher
from tests.conftest import Db, Roles, dsn_as
from tests.deliveries import ORDERED, read_queue
from tests.deliveries import check_deliveries as check_queue
from tests.helpers import free_port, http_get
from tests.producers import merged, producers_both_ways
from tests.rabbitmq_broker import Rabbit
from tests.relay_process import (
    RELAY,
    RelayProcess,
    popen_with_ctrl_c,
    relay_env,
    run_relay,
    wait_until,
    wait_until_async,
)


@dataclass
class Outbox:
    """One outbox of a test's fleet: its name in the config and where it is."""

    name: str
    owner_dsn: str
    names: OutboxNames
    relay_dsn: str
    producer_dsn: str
    db: Db


@pytest.fixture
def make_outbox(roles: Roles) -> Iterator[Callable[[str, str], Outbox]]:
    """``make_outbox(name, owner_dsn)``: a migrated outbox in a schema of its own in the
    database of ``owner_dsn``, the suite's producer and relay roles granted; dropped after."""
    made: list[tuple[Outbox, list[psycopg.Connection[Any]]]] = []

    def make(name: str, owner_dsn: str) -> Outbox:
        names = OutboxNames(schema=f"f_{uuid.uuid4().hex[:12]}", table="outbox")
        with psycopg.connect(owner_dsn, autocommit=True) as conn, conn.transaction():
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(names.schema)))
            conn.execute(names.render(schema_sql()))
        grant_roles(owner_dsn, names, roles)
        producer_dsn = dsn_as(owner_dsn, roles.producer)
        conns = [psycopg.connect(owner_dsn, autocommit=True), psycopg.connect(producer_dsn, autocommit=True)]
        outbox = Outbox(
            name, owner_dsn, names, dsn_as(owner_dsn, roles.relay), producer_dsn, Db(conns[0], names, conns[1])
        )
        made.append((outbox, conns))
        return outbox

    yield make
    for outbox, conns in made:
        for c in conns:
            c.close()
        try:
            with psycopg.connect(outbox.owner_dsn, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(outbox.names.schema)))
        except psycopg.OperationalError:
            pass  # its scratch database is gone already, and the schema with it


def grant_roles(owner_dsn: str, names: OutboxNames, roles: Roles) -> None:
    """What `relay migrate --grant-producer --grant-relay` grants (relay.db.grants), from a
    test's own thread."""
    with psycopg.connect(owner_dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (GRANTS_LOCK,))
        [(database,)] = conn.execute("SELECT current_database()::text").fetchall()
        for grantee in (Grantee("producer", roles.producer), Grantee("relay", roles.relay)):
            for statement in statements(names, grantee, database):
                conn.execute(statement)


def fleet_config(path: Path, outboxes: list[Outbox], top: str, each: Callable[[Outbox], str] = lambda o: "") -> str:
    """A config file listing ``outboxes`` (each as the relay role), ``top`` above them."""
    entries = "".join(
        f'\n[[outboxes]]\nname = "{o.name}"\ndsn = "{o.relay_dsn}"\nschema = "{o.names.schema}"\n{each(o)}'
        for o in outboxes
    )
    path.write_text(top + entries)
    return str(path)


def database_of(dsn: str) -> str:
    return conninfo_to_dict(dsn)["dbname"]


def set_database(pg_dsn: str, database: str, setting: sql.Composable, role: str) -> None:
    """An ALTER DATABASE, then every session ``role`` (the relays') has in that database
    ended, so that its next ones meet the change (what a DBA's change or a failover looks
    like to the relay). The test's own sessions stay."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} ").format(sql.Identifier(database)) + setting)
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND usename = %s",
            (database, role),
        )


def readyz(port: int) -> tuple[int, str]:
    try:
        return http_get(f"http://127.0.0.1:{port}/readyz")
    except OSError:
        return 0, ""


def line_of(body: str, name: str) -> str:
    return next((line for line in body.splitlines() if line.startswith(f"outbox {name}:")), "")


async def test_one_process_delivers_each_outbox_in_its_commit_order(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str, scratch_dsn: str, rabbit: Rabbit, tmp_path: Path
) -> None:
    # Two outboxes in the test database, one in a database of its own; each to its own queue.
    outboxes = [make_outbox("billing", pg_dsn), make_outbox("shipping", pg_dsn), make_outbox("tenant-3", scratch_dsn)]
    queues = {}
    for o in outboxes:
        exchange = await rabbit.exchange("topic")
        queues[o.name] = (exchange, await rabbit.queue(bind=(exchange, "#")))
        stored = run_relay(
            "migrate", "--dsn", o.owner_dsn, "--schema", o.names.schema, "--ordering-default", "unordered",
            "--ordered", ORDERED,
        )  # fmt: skip
        assert stored.returncode == 0, stored.stderr
    config = fleet_config(
        tmp_path / "relay.toml",
        outboxes,
        f'broker = "rabbitmq"\nworkers = 2\nbatch_size = 20\n[rabbitmq]\nurl = "{rabbit.amqp.url}"\n',
        # Each outbox its own exchange: a table of the entry, over the file's [rabbitmq].
        lambda o: f'[outboxes.rabbitmq]\nexchange = "{queues[o.name][0]}"\n',
    )
    process = RelayProcess("start", "--config", config, env=relay_env())
    try:
        producing = [
            producers_both_ways(
                o.owner_dsn,
                o.names,
                locked_aggregates=[f"order-L{i}" for i in range(4)],
                unlocked_aggregates=[f"order-U{i}" for i in range(3)],
                locked_tx=8,
                unlocked_rounds=6,
                seeds=(i, i + 10),
                locked_options={"unordered_type": "EmailQueued", "pause_s": 0.01},
                unlocked_options={"pause_s": (0.0, 0.05)},
                producer_dsn=o.producer_dsn,
            )
            for i, o in enumerate(outboxes)
        ]
        for _, _, thread in producing:
            thread.join(timeout=120)
        for o, (locked, unlocked, _) in zip(outboxes, producing, strict=True):
            ids = {r["id"] for r in o.db.rows()}
            got = await read_queue(rabbit.amqp, queues[o.name][1], ids, timeout=60)
            assert got, (o.name, o.db.statuses(), process.tail())
            check_queue(o.db, got, merged(locked, unlocked))
        assert process.running(), process.tail()
        log = process.stderr()
        assert "relay started: 3 outboxes (billing, shipping, tenant-3), 2 database pools, 3 broker connections" in log
        # Each outbox's lines name it (the start of each run, at least).
        for o in outboxes:
            assert f"outbox {o.names.qualified}" in log and f"outbox={o.name}" in log
    finally:
        process.stop()
    process.assert_clean_exit()


async def test_an_outbox_held_by_its_database_holds_nothing_else_and_resumes_by_itself(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str, scratch_dsn: str, roles: Roles, tmp_path: Path
) -> None:
    steady, other = make_outbox("steady", pg_dsn), make_outbox("other", scratch_dsn)
    port = free_port()
    config = fleet_config(
        tmp_path / "relay.toml",
        [steady, other],
        f'broker = "log"\nworkers = 1\npoll_interval = "200ms"\nmetrics_port = {port}\nmetrics_host = "127.0.0.1"\n'
        'backoff_base = "100ms"\n',
    )
    process = RelayProcess("start", "--config", config, env=relay_env(), discard_stdout=True)
    database = database_of(other.owner_dsn)
    n = 0

    def delivered_promptly(outbox: Outbox) -> float:
        """Insert one event into ``outbox``: seconds until it is done."""
        nonlocal n
        n += 1
        [oid] = outbox.db.insert([(f"a-{n}", "OrderPlaced", {"n": n})])
        began = time.monotonic()
        assert wait_until(lambda: outbox.db.row(oid)["status"] == "done", timeout=10), (outbox.name, process.tail())
        return time.monotonic() - began

    try:
        assert wait_until(lambda: readyz(port)[0] == 200, timeout=20), process.tail()
        body = readyz(port)[1]
        assert body.startswith("ready") and "outbox steady: ready" in body and "outbox other: ready" in body, body
        delivered_promptly(other)

        def held_alone(why: str) -> None:
            assert wait_until(lambda: "held" in line_of(readyz(port)[1], "other"), timeout=30), (
                why,
                readyz(port),
                process.tail(),
            )
            status, body = readyz(port)
            assert status == 503 and body.startswith("not ready: 1 of 2 outboxes held: other"), (why, body)
            assert line_of(body, "steady") == "outbox steady: ready", (why, body)
            for _ in range(3):
                assert delivered_promptly(steady) < 3, why

        def resumed(why: str) -> None:
            assert wait_until(lambda: readyz(port)[0] == 200, timeout=60), (why, readyz(port), process.tail())
            delivered_promptly(other)

        # Its database goes away (no new connection is let in, the old ones are ended).
        set_database(pg_dsn, database, sql.SQL("ALLOW_CONNECTIONS false"), roles.relay)
        held_alone("database gone")
        set_database(pg_dsn, database, sql.SQL("ALLOW_CONNECTIONS true"), roles.relay)
        resumed("database back")

        # It turns read-only (a standby promoted the other way, or a DBA's setting).
        set_database(pg_dsn, database, sql.SQL("SET default_transaction_read_only = on"), roles.relay)
        held_alone("read-only")
        assert "read-only transaction" in process.stderr()
        set_database(pg_dsn, database, sql.SQL("RESET default_transaction_read_only"), roles.relay)
        resumed("writable again")

        # Its grants are revoked from the relay's role, then granted again.
        with psycopg.connect(other.owner_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(
                    sql.Identifier(other.names.schema), sql.Identifier(roles.relay)
                )
            )
        # Sessions keep what they had looked up: the relay meets the change in new ones.
        set_database(pg_dsn, database, sql.SQL("RESET ALL"), roles.relay)
        other.db.insert([("a-revoked", "OrderPlaced", {})])
        held_alone("grants revoked")
        assert "permission denied" in process.stderr()
        grant_roles(other.owner_dsn, other.names, roles)
        resumed("granted again")
        assert other.db.statuses() == {"done": len(other.db.rows())}
    finally:
        set_database(pg_dsn, database, sql.SQL("ALLOW_CONNECTIONS true"), roles.relay)
        set_database(pg_dsn, database, sql.SQL("RESET default_transaction_read_only"), roles.relay)
        process.stop()
    process.assert_clean_exit()


async def test_a_locked_outbox_table_slows_only_its_own_outbox(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str
) -> None:
    # In-process, through relay.Relay(outboxes=...): the same outbox list as a config file.
    slow, quick = make_outbox("slow", pg_dsn), make_outbox("quick", pg_dsn)
    publisher = InMemoryPublisher()
    relay = Relay(
        publisher=publisher,
        workers=1,
        poll_interval=0.2,
        outboxes=[
            {"name": o.name, "dsn": o.relay_dsn, "schema": o.names.schema, "statement_timeout": "2s"}
            for o in (slow, quick)
        ],
    )
    assert relay.outboxes == ("slow", "quick")
    async with relay:
        [first] = slow.db.insert([("s-0", "OrderPlaced", {})])
        assert await wait_until_async(lambda: slow.db.row(first)["status"] == "done", timeout=10)
        with psycopg.connect(pg_dsn) as locker:
            locker.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(slow.db.table))
            waited = []
            for i in range(5):
                [oid] = await asyncio.to_thread(quick.db.insert, [(f"q-{i}", "OrderPlaced", {"i": i})])
                began = time.monotonic()
                assert await wait_until_async(lambda oid=oid: quick.db.row(oid)["status"] == "done", timeout=10)
                waited.append(time.monotonic() - began)
            assert max(waited) < 2, waited  # the slow outbox's statements wait out their 2 s timeout meanwhile
            locker.rollback()
        [late] = slow.db.insert([("s-1", "OrderPlaced", {})])
        assert await wait_until_async(lambda: slow.db.row(late)["status"] == "done", timeout=30)
    assert relay.failed is None
    assert len(publisher.delivered) == 7


async def test_one_console_shows_every_outbox_and_acts_on_each_apart(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str, tmp_path: Path
) -> None:
    billing, shipping = make_outbox("billing", pg_dsn), make_outbox("shipping", pg_dsn)
    [dead] = billing.db.insert([("order-1", "OrderPlaced", {})])
    billing.db.conn.execute(
        sql.SQL("UPDATE {} SET status = 'dead', attempts = 1, last_error = 'PermanentError: no such customer'").format(
            billing.db.table
        )
    )
    shipping.db.insert([("order-9", "ShipmentBooked", {})])
    port, secret = free_port(), "s3cret-token-0123456789abcdef"
    config = fleet_config(tmp_path / "relay.toml", [billing, shipping], "")
    console = RelayProcess(
        "console", "--config", config, "--port", str(port), "--allow-actions", "--token", f"alice={secret}",
        env=relay_env(),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: readyz_of(url) == 200, timeout=20), console.tail()
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:

            async def page(path: str, **form: str) -> tuple[int, str]:
                call = session.post(url + path, data=form) if form else session.get(url + path)
                async with call as r:
                    return r.status, html.unescape(await r.text())

            status, index = await page("/")
            assert status == 200, index
            rows = dict(re.findall(r'data-testid="outbox-([a-z-]+)">(.*?)</tr>', index, re.S))
            assert set(rows) == {"billing", "shipping"}
            assert 'href="/o/billing/dead">1<' in rows["billing"] and billing.names.qualified in rows["billing"]
            assert re.search(r'data-testid="awaiting">1<', rows["shipping"]), rows["shipping"]
            # Each outbox's own pages, under its prefix, every link kept within it.
            status, dead_page = await page("/o/billing/dead")
            assert status == 200 and "no such customer" in dead_page, dead_page
            links = re.findall(r'(?:href|action)="(/[^"]*)"', dead_page)
            assert links and all(link == "/" or link.startswith("/o/billing/") for link in links), links
            status, shipping_page = await page("/o/shipping/")
            assert status == 200 and shipping.names.qualified in shipping_page
            # An action on one outbox: signed in by the token, then confirmed with its CSRF value.
            status, preview = await page("/o/billing/actions/preview", action="retry", ids=str(dead), token=secret)
            assert status == 200, preview
            csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', preview)
            assert csrf, preview
            status, done = await page("/o/billing/actions/apply", action="retry", ids=str(dead), csrf=csrf.group(1))
            assert status == 200 and "1 message re-driven" in done, done
        assert billing.db.row(dead)["status"] == "pending" and shipping.db.statuses() == {"pending": 1}
    finally:
        console.stop()


def readyz_of(url: str) -> int:
    try:
        return http_get(url + "/")[0]
    except OSError:
        return 0


async def test_cancelling_a_relay_of_several_outboxes_hands_every_row_back(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str
) -> None:
    # An application shutting down cancels the task running its relay: every outbox's rows
    # in flight go back unspent, and nothing is left running.
    outboxes = [make_outbox("a", pg_dsn), make_outbox("b", pg_dsn)]
    for o in outboxes:
        o.db.insert([(f"x-{i}", "OrderPlaced", {"i": i}) for i in range(40)])
    publisher = InMemoryPublisher(delay=0.3)  # each batch is in flight a while
    relay = Relay(
        publisher=publisher,
        workers=2,
        batch_size=5,
        outboxes=[{"name": o.name, "dsn": o.relay_dsn, "schema": o.names.schema} for o in outboxes],
    )
    task = asyncio.ensure_future(relay.run())
    assert await wait_until_async(lambda: all(o.db.statuses().get("processing") for o in outboxes), timeout=10)
    tasks_before = len(asyncio.all_tasks())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    for o in outboxes:
        rows = o.db.rows()
        assert {r["status"] for r in rows} <= {"pending", "done"}, o.db.statuses()
        assert all(r["attempts"] == (1 if r["status"] == "done" else 0) for r in rows)
    assert len(asyncio.all_tasks()) < tasks_before  # the relay's tasks ended with it
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith(("relay ", "outbox-relay"))]


async def test_one_listening_connection_wakes_each_outbox_of_a_database(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str
) -> None:
    # Polls 30 s apart: only a wake-up can deliver within the second each event is given.
    outboxes = [make_outbox(name, pg_dsn) for name in ("a", "b", "c")]
    publisher = InMemoryPublisher()
    relay = Relay(
        publisher=publisher,
        workers=1,
        poll_interval=30,
        outboxes=[{"name": o.name, "dsn": o.relay_dsn, "schema": o.names.schema} for o in outboxes],
    )
    async with relay:
        # The sessions whose last statement was a LISTEN on one of these outboxes' channels
        # (other tests' relays listen in this database too).
        listening = (
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN%%'"
            " AND query LIKE ANY (%s)"
        )
        await asyncio.sleep(0.5)  # the first look of each worker, and its presence row written idle
        for o in [*outboxes, outboxes[0]]:
            [oid] = await asyncio.to_thread(o.db.insert, [("order-1", "OrderPlaced", {})])
            assert await wait_until_async(lambda o=o, oid=oid: o.db.row(oid)["status"] == "done", timeout=2), o.name
        ours = [f"%{o.names.schema}%" for o in outboxes]
        [(sessions,)] = outboxes[0].db.conn.execute(listening, (ours,)).fetchall()
    assert sessions == 1
    assert len(publisher.delivered) == 4


def test_status_shows_every_listed_outbox_and_says_which_cannot_be_read(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str, tmp_path: Path
) -> None:
    a, b = make_outbox("a", pg_dsn), make_outbox("b", pg_dsn)
    a.db.insert([("x", "OrderPlaced", {}), ("y", "OrderPlaced", {})])
    config = fleet_config(tmp_path / "relay.toml", [a, b], "")
    shown = run_relay("status", "--config", config, "--json", env=relay_env())
    assert shown.returncode == 0, shown.stderr
    parts = json.loads(shown.stdout)["outboxes"]
    assert [p["outbox"] for p in parts] == ["a", "b"]
    assert [p["summary"]["pending_ordered"] + p["summary"]["pending_unordered"] for p in parts] == [2, 0]
    text = run_relay("status", "--config", config, env=relay_env())
    assert text.returncode == 0 and "== outbox a" in text.stdout and "== outbox b" in text.stdout
    assert a.names.qualified in text.stdout and b.names.qualified in text.stdout
    # One outbox's table gone: the others are shown, it says why, and the command fails.
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(b.names.schema)))
    broken = run_relay("status", "--config", config, env=relay_env())
    assert broken.returncode == 1, broken.stderr
    assert "== outbox a" in broken.stdout and "== outbox b\nerror: " in broken.stdout, broken.stdout
    assert "Traceback" not in broken.stderr


def test_status_watch_of_several_outboxes_prints_a_frame_of_all_of_them(
    make_outbox: Callable[[str, str], Outbox], pg_dsn: str, tmp_path: Path
) -> None:
    a, b = make_outbox("a", pg_dsn), make_outbox("b", pg_dsn)
    b.db.insert([("x", "OrderPlaced", {})])
    config = fleet_config(tmp_path / "relay.toml", [a, b], "")
    proc = popen_with_ctrl_c(
        [RELAY, "status", "--config", config, "--watch", "--interval", "200ms", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=relay_env(),
    )
    assert proc.stdout is not None
    frames = [json.loads(proc.stdout.readline()) for _ in range(2)]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    for frame in frames:
        assert [(p["outbox"], p["summary"]["pending"]) for p in frame["outboxes"]] == [("a", 0), ("b", 1)]
