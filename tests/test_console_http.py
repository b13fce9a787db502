"""`relay console` over HTTP against a real PostgreSQL: every page renders what the seeded
outbox holds, actions follow `relay dead`'s rules and refuse without the token, a forged
or cross-site form, and nothing on any page carries a password or unescaped producer
markup. (tests/test_console_browser.py drives the same pages in Chromium.)"""

from __future__ import annotations

import html
import re
from datetime import timedelta
from typing import Any

import aiohttp

from relay.message import Decision
from relay.ops.deadletters import group_key
from relay.store import OutboxStore
from tests.conftest import Db
from tests.console_seed import (
    BILLING_500,
    ORDERING,
    SCHEMA,
    SECRET,
    RunningConsole,
    Seeded,
)
from tests.ops_helpers import claim_until

Session = aiohttp.ClientSession


def client() -> Session:
    # unsafe=True: keep cookies from a numeric host (127.0.0.1), as a browser does.
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def get(url: str, path: str, session: Session | None = None) -> tuple[int, str]:
    own = session is None
    session = session or client()
    try:
        async with session.get(url + path) as r:
            # Entities decoded: the assertions read the text a person sees.
            return r.status, html.unescape(await r.text())
    finally:
        if own:
            await session.close()


async def raw_get(url: str, path: str) -> tuple[int, str]:
    """The page as sent, entities and all."""
    async with client() as session, session.get(url + path) as r:
        return r.status, await r.text()


def text_of(page: str) -> str:
    """The page's text, tags dropped and whitespace folded, for plain assertions."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page))


def by_testid(page: str, name: str) -> str:
    m = re.search(rf'data-testid="{re.escape(name)}"[^>]*>(.*?)</', page, re.S)
    assert m, f"no data-testid={name!r} on the page"
    return " ".join(m.group(1).split())


async def test_the_overview_counts_the_seeded_outbox(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory(allow_actions=False)
    status, page = await get(c.url, "/")
    assert status == 200
    counts = db.statuses()
    assert by_testid(page, "dead") == str(counts["dead"]) == str(s.dead)
    assert by_testid(page, "awaiting") == str(counts["pending"]) == str(len(s.pending))
    assert by_testid(page, "blocked") == str(len(s.dead_heads))
    assert "actions off" in text_of(page)
    # The live fragment the page polls carries the same figures.
    status, fragment = await get(c.url, "/fragments/overview")
    assert status == 200 and by_testid(fragment, "dead") == str(s.dead)


async def test_the_dead_page_groups_by_error_and_filters(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded]
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    _, page = await get(c.url, "/dead")
    billing = group_key(BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
    schema = group_key(SCHEMA)
    assert f'data-testid="group-{billing}"' in page and f'data-testid="group-{schema}"' in page
    assert by_testid(page, "dead-total").startswith(f"{s.dead} dead messages in 3 groups")
    _, group_page = await get(c.url, f"/dead/{billing}")
    for oid in s.billing:
        assert f'data-testid="dead-{oid}"' in group_page
    assert all(f'data-testid="dead-{oid}"' not in group_page for oid in s.schema + s.mailer)
    _, filtered = await get(c.url, "/dead?event_type=EmailQueued")
    assert by_testid(filtered, "dead-total").startswith("2 dead messages in 1 group")
    status, bad = await get(c.url, "/dead?aggregate=" + "x" * 501)
    assert status == 400 and "invalid aggregate: longer than 500 characters" in bad


async def test_message_blocked_and_aggregate_pages(console_factory: Any, seeded: tuple[OutboxStore, Seeded]) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    head, behind = s.dead_heads["order-17"], s.behind["order-17"]
    _, page = await get(c.url, f"/messages/{head}")
    assert '"order": 17' in page and "billing answered 500 for order 17" in page
    assert by_testid(page, "position").startswith("aggregate_seq 1: the head of its aggregate")
    _, follower = await get(c.url, f"/messages/{behind[1]}")
    assert by_testid(follower, "position").startswith(f"aggregate_seq 3: 2 ahead of it (head #{head}")
    _, blocked = await get(c.url, "/blocked")
    assert by_testid(blocked, "blocked-total").startswith("3 ordered aggregates")
    order = [int(i) for i in re.findall(r'data-testid="blocked-(\d+)"', blocked)]
    assert order == sorted(s.dead_heads.values())  # oldest dead head first (seeded in that order)
    _, agg = await get(c.url, "/aggregate?id=order-17")
    assert by_testid(agg, "state") == "BLOCKED"
    rows = [int(i) for i in re.findall(r'data-testid="row-(\d+)"', agg)]
    assert rows == sorted([head, *behind], reverse=True)
    status, _ = await get(c.url, "/messages/999999999")
    assert status == 404
    status, _ = await get(c.url, "/messages/12x")
    assert status == 400


async def action(
    session: Session, c: RunningConsole, path: str, form: dict[str, str], **headers: str
) -> tuple[int, str]:
    async with session.post(c.url + path, data=form, headers=headers) as r:
        return r.status, html.unescape(await r.text())


async def test_a_retry_needs_the_token_previews_then_re_drives_in_order(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    store, s = seeded
    c: RunningConsole = await console_factory()
    head = s.dead_heads["order-17"]
    async with client() as session:
        # No token, a wrong one: 403, nothing read or written.
        for form in ({"action": "retry", "ids": str(head)}, {"action": "retry", "ids": str(head), "token": "x" * 20}):
            status, page = await action(session, c, "/actions/preview", form)
            assert status == 403, page
        status, page = await action(
            session, c, "/actions/apply", {"action": "retry", "ids": str(head), "token": "wrong" * 4}
        )
        assert status == 403 and db.row(head)["status"] == "dead"
        # The token signs in; the preview changes nothing and names what would change.
        status, page = await action(
            session, c, "/actions/preview", {"action": "retry", "ids": str(head), "token": SECRET}
        )
        assert status == 200 and by_testid(page, "preview-count").startswith("1 dead message would be re-driven")
        assert db.row(head)["status"] == "dead"
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert csrf
        # Through the session, the confirm needs the form's check value and the console's own origin.
        form = {"action": "retry", "ids": str(head), "reason": ""}
        assert (await action(session, c, "/actions/apply", form))[0] == 403
        assert (await action(session, c, "/actions/apply", {**form, "csrf": "0" * 64}))[0] == 403
        evil = {**form, "csrf": csrf.group(1)}
        assert (await action(session, c, "/actions/apply", evil, Origin="https://evil.example"))[0] == 403
        assert db.row(head)["status"] == "dead"
        status, page = await action(session, c, "/actions/apply", {**form, "csrf": csrf.group(1)})
        assert status == 200, page
        assert by_testid(page, "done").startswith("1 message re-driven")
    row = db.row(head)
    assert (row["status"], row["attempts"], row["resolution"], row["resolved_by"]) == ("pending", 0, "retried", "alice")
    # The relay takes the aggregate on from its head, in order.
    claimed = await store.claim(owner="w", batch=10, lease=timedelta(minutes=1), max_attempts=3)
    assert head in [m.id for m in claimed.messages]
    assert not set(s.behind["order-17"]) & {m.id for m in claimed.messages}


async def test_a_skip_needs_a_reason_and_a_group_skip_writes_exactly_the_previewed_rows(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory(by="oncall@example")
    billing = group_key(BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
    auth = {"Authorization": f"Bearer {SECRET}"}
    async with client() as session:
        status, page = await action(session, c, "/actions/preview", {"action": "skip", "group": billing}, **auth)
        assert status == 400 and "a skip needs a reason" in page
        status, page = await action(
            session, c, "/actions/preview", {"action": "skip", "group": billing, "reason": "refunded by hand"}, **auth
        )
        assert status == 200 and by_testid(page, "preview-count").startswith("2 dead messages would be marked done")
        ids = re.search(r'name="ids" value="([0-9 ]+)"', page)
        assert ids and sorted(int(i) for i in ids.group(1).split()) == sorted(s.billing)
        status, page = await action(
            session, c, "/actions/apply", {"action": "skip", "ids": ids.group(1), "reason": "refunded by hand"}, **auth
        )
        assert status == 200, page
        # Already skipped: refused as a whole, nothing changes (409).
        status, page = await action(session, c, "/actions/apply", {"action": "retry", "ids": ids.group(1)}, **auth)
        assert status == 409 and "not dead (status done)" in page
    for oid in s.billing:
        row = db.row(oid)
        assert (row["status"], row["resolution"], row["resolved_by"], row["resolved_note"]) == (
            "done", "skipped", "oncall@example", "refunded by hand",
        )  # fmt: skip
    assert all(db.row(oid)["status"] == "dead" for oid in s.schema + s.mailer)


async def test_actions_are_off_unless_allowed(console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory(allow_actions=False)
    head = s.dead_heads["order-17"]
    _, page = await get(c.url, f"/messages/{head}")
    assert "retry-form" not in page
    async with client() as session:
        status, page = await action(
            session, c, "/actions/apply", {"action": "retry", "ids": str(head)}, Authorization=f"Bearer {SECRET}"
        )
    assert status == 403 and "actions are off" in page
    assert db.row(head)["status"] == "dead"


async def test_no_page_shows_a_password_a_token_or_producer_markup(
    console_factory: Any, db: Db, make_store: Any
) -> None:
    store = await make_store(ORDERING)
    [oid] = db.insert([("<script>alert(1)</script>", "Order<b>Placed", {"html": "<img src=x onerror=alert(1)>"})])
    claimed = await claim_until(store, {oid})
    await store.finalize([Decision.dead(claimed[oid], "could not reach postgresql://u:hunter22@db/x")])
    c: RunningConsole = await console_factory()
    agg = "%3Cscript%3Ealert(1)%3C%2Fscript%3E"
    for path in ("/", "/dead", f"/messages/{oid}", "/blocked", f"/aggregate?id={agg}"):
        status, page = await raw_get(c.url, path)
        assert status == 200, (path, page)
        assert "<script>alert" not in page and "<img src=x" not in page and "<b>Placed" not in page, path
        assert "hunter22" not in page and SECRET not in page, path
    _, page = await raw_get(c.url, f"/messages/{oid}")
    assert "&lt;img src=x onerror=alert(1)&gt;" in page  # shown as text
    assert db.row(oid)["aggregate_id"] == "<script>alert(1)</script>"
