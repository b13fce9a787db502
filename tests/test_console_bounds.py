"""The console and `relay dead list --group` stay bounded whatever the table holds: groups are
counted in SQL (the dead_group column, migration 0014) and paged, a group's messages are
paged by id, long cells are cut, a payload shows its first KiB with the whole one streamed
on request, the overview lists the busiest event types only, and nothing a user typed is
echoed through the secret mask (which made the page an oracle for the token and the DSN's
password). The figures at a million dead rows are scripts/bench_console.py's."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from relay.db.migrate import migrate
from relay.db.names import OutboxNames
from relay.db.readmodel import DeadFilter
from relay.ops.deadletters import GROUPS_PER_PAGE, group_dead
from tests.conftest import Db
from tests.console_seed import TOKEN, RunningConsole
from tests.ops_helpers import group_key
from tests.relay_process import run_relay

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima"]


def word(k: int) -> str:
    """A distinct error word per k, with no digits (numbers are what fingerprints replace)."""
    return f"{WORDS[k % 12]}-{WORDS[(k // 12) % 12]}-{WORDS[k // 144]}"


def fill_dead(db: Db, groups: dict[str, int]) -> dict[str, list[int]]:
    """Dead rows as a relay would leave them (status dead, an error each), inserted in one
    statement per error: ``groups`` maps an error's word to how many rows carry it, each
    with its own numbers (which the fingerprint replaces). The oracle: error word -> ids."""
    ids: dict[str, list[int]] = {}
    with db.conn.transaction():
        for w, n in groups.items():
            rows = db.conn.execute(
                sql.SQL(
                    "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error,"
                    " ordered) SELECT 'order', 'o-' || g, 'E', '{{}}', 'dead', 1,"
                    " 'PermanentError: ' || %s || ' refused order ' || g || ' (' || (g * 7) || ' bytes)', false"
                    " FROM generate_series(1, %s) AS g RETURNING id"
                ).format(db.table),
                (w, n),
            ).fetchall()
            ids[w] = [r[0] for r in rows]
    return ids


async def test_groups_are_counted_and_paged_in_sql(db: Db, names: OutboxNames, pg_dsn: str, relay_dsn: str) -> None:
    # 130 groups (3 pages of 50) of 1 to 40 rows; one group of 450 (3 pages of its messages).
    sizes = {word(k): 1 + (k * 7) % 40 for k in range(129)}
    sizes[word(129)] = 450
    oracle = fill_dead(db, sizes)
    expected = sorted(((len(v), min(v), w) for w, v in oracle.items()), key=lambda t: (-t[0], t[1]))
    seen: list[tuple[int, int, str]] = []
    for page in (1, 2, 3):
        out = run_relay("dead", "list", "--group", "--json", "--page", str(page), "--dsn", relay_dsn,
                        "--schema", names.schema)  # fmt: skip
        assert out.returncode == 0, out.stderr
        view = json.loads(out.stdout)
        assert (view["total_groups"], view["total"], view["pages"]) == (130, sum(sizes.values()), 3)
        for g in view["groups"]:
            w = re.search(r"PermanentError: (\S+) refused", g["fingerprint"])
            assert w, g["fingerprint"]
            assert g["fingerprint"] == f"PermanentError: {w.group(1)} refused order <n> (<n> bytes)"
            seen.append((g["count"], g["first_id"], w.group(1)))
            assert g["key"] == group_key(pg_dsn, names, f"PermanentError: {w.group(1)} refused order 1 (7 bytes)")
    assert seen == expected  # every group once, largest first, each count as inserted
    past = run_relay("dead", "list", "--group", "--page", "4", "--dsn", relay_dsn, "--schema", names.schema)
    assert past.returncode == 0 and past.stdout.strip() == "no page 4: 130 groups fill 3 pages"
    async with await psycopg.AsyncConnection.connect(relay_dsn) as conn:
        filtered = await group_dead(conn, names, DeadFilter(error=word(129)))
    assert [(g.count, g.first_id) for g in filtered.groups] == [(450, min(oracle[word(129)]))]
    assert GROUPS_PER_PAGE == 50


async def test_the_console_pages_groups_and_a_groups_messages(
    db: Db, names: OutboxNames, pg_dsn: str, console_factory: Any
) -> None:
    sizes = {word(k): 2 for k in range(60)}
    sizes[word(60)] = 450
    oracle = fill_dead(db, sizes)
    c: RunningConsole = await console_factory()
    async with aiohttp.ClientSession() as session:
        keys: list[str] = []
        for page in (1, 2):
            async with session.get(f"{c.url}/dead?page={page}") as r:
                text = await r.text()
            assert r.status == 200
            keys += re.findall(r'data-testid="group-([0-9a-f]{16})"', text)
        assert len(keys) == len(set(keys)) == 61
        big = group_key(pg_dsn, names, f"PermanentError: {word(60)} refused order 1 (7 bytes)")
        assert keys[0] == big  # the largest first
        listed: list[int] = []
        path = f"/dead/{big}"
        while path:
            async with session.get(c.url + path) as r:
                text = await r.text()
            assert r.status == 200
            listed += [int(i) for i in re.findall(r'data-testid="dead-(\d+)"', text)]
            more = re.search(r'href="(/dead/[0-9a-f]{16}\?after=\d+)" rel="next"', text)
            path = more.group(1) if more else ""
        assert listed == sorted(oracle[word(60)])  # 200 + 200 + 50, each once, in id order
        async with session.get(f"{c.url}/dead?page=x") as r:
            assert r.status == 400 and "invalid page" in await r.text()


async def test_nothing_typed_is_echoed_through_the_secret_mask(db: Db, console_factory: Any) -> None:
    """`?error=GUESS` used to come back as *** exactly when GUESS was the token (or the
    DSN's password): an oracle for anyone who can read the pages. Both now come back as
    typed, escaped."""
    fill_dead(db, {"alpha": 1})
    c: RunningConsole = await console_factory()
    secret = TOKEN.split("=", 1)[1]
    pages = {}
    async with aiohttp.ClientSession() as session:
        for guess in (secret, secret[:-1] + "x", '<b>"x"</b>'):
            async with session.get(f"{c.url}/dead", params={"error": guess}) as r:
                pages[guess] = await r.text()
    for guess, text in pages.items():
        escaped = guess.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&#34;")
        assert f'name="error" value="{escaped}"' in text, guess
    assert "***" not in pages[secret]
    assert "<b>" not in pages['<b>"x"</b>']


async def test_a_payload_page_shows_its_first_kib_and_streams_the_whole(db: Db, console_factory: Any) -> None:
    payload = {"blob": "x" * 5_000_000, "tail": "é" * 1000}
    [oid] = db.insert([("a", "E", payload)])
    c: RunningConsole = await console_factory()
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{c.url}/messages/{oid}") as r:
            page = await r.text()
        assert r.status == 200 and len(page) < 50_000
        assert 'data-testid="payload-whole"' in page
        async with session.get(f"{c.url}/messages/{oid}/payload") as r:
            whole = await r.read()
        assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
    assert json.loads(whole) == payload
    async with aiohttp.ClientSession() as session, session.get(f"{c.url}/messages/999999999/payload") as r:
        assert r.status == 404


async def test_the_overview_lists_the_busiest_event_types_only(db: Db, console_factory: Any) -> None:
    db.insert([("a", f"Type{k:03d}", {}) for k in range(70) for _ in range(1 + (k == 3) * 5)])
    c: RunningConsole = await console_factory()
    async with aiohttp.ClientSession() as session, session.get(f"{c.url}/fragments/overview") as r:
        text = await r.text()
    assert text.count("<tr><td>Type") == 50
    assert "Type003" in text  # the busiest is among them
    assert "of 70; <code>relay status --by-event-type</code>" in text


async def test_the_trigger_groups_rows_as_they_die_and_the_migration_groups_those_dead_before(
    pg_dsn: str, outbox_at: Callable[[int], OutboxNames], owner_pool: AsyncConnectionPool[Any]
) -> None:
    names = outbox_at(13)
    table = sql.Identifier(names.schema, names.table)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload, status, attempts, last_error,"
                " ordered) SELECT 'order', 'o', 'E', '{{}}', 'dead', 1, 'boom ' || g, false"
                " FROM generate_series(1, 5) AS g"
            ).format(table)
        )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await migrate(conn, names)
        before = await group_dead(conn, names, DeadFilter())
    assert [(g.count, g.fingerprint) for g in before.groups] == [(5, "boom <n>")]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # Re-driven, then dead again with another error: it moves to that error's group.
        conn.execute(
            sql.SQL("UPDATE {} SET status = 'pending' WHERE id = (SELECT min(id) FROM {})").format(table, table)
        )
        conn.execute(
            sql.SQL("UPDATE {} SET status = 'dead', last_error = 'queue ''q'' gone' WHERE status = 'pending'").format(
                table
            )
        )
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        after = await group_dead(conn, names, DeadFilter())
    assert Counter((g.count, g.fingerprint) for g in after.groups) == Counter([(4, "boom <n>"), (1, "queue '?' gone")])
