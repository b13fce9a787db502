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
import pytest

from relay.console import pages
from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from relay.message import Decision
from tests.conftest import Db
from tests.console_seed import (
    BILLING_500,
    ORDERING,
    SCHEMA,
    SECRET,
    RunningConsole,
    Seeded,
)
from tests.ops_helpers import claim_until, group_key

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
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], pg_dsn: str, names: OutboxNames
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    _, page = await get(c.url, "/dead")
    billing = group_key(pg_dsn, names, BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
    schema = group_key(pg_dsn, names, SCHEMA)
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
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db, pg_dsn: str, names: OutboxNames
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory(by="oncall@example")
    billing = group_key(pg_dsn, names, BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
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


async def test_a_confirm_refuses_a_message_claimed_again_since_its_preview(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    store, s = seeded
    c: RunningConsole = await console_factory()
    email = s.mailer[0]
    first_error = db.row(email)["last_error"]
    bob = {"Authorization": f"Bearer {SECRET}"}
    async with client() as alice:
        # Alice previews a skip of the email that failed with the mailer's error ...
        status, page = await action(
            alice,
            c,
            "/actions/preview",
            {"action": "skip", "ids": str(email), "reason": "bad address", "token": SECRET},
        )
        assert status == 200, page
        confirm = dict(re.findall(r'name="(ids|versions|reason|action|csrf)" value="([^"]*)"', page))
        assert confirm["ids"] == str(email) and confirm["versions"] == str(db.row(email)["lease_version"])
        # ... meanwhile Bob re-drives it, a relay claims it, and it dies of something else.
        async with client() as session:
            status, page = await action(session, c, "/actions/apply", {"action": "retry", "ids": str(email)}, **bob)
            assert status == 200, page
        claimed = await claim_until(store, {email})
        assert not await store.finalize([Decision.dead(claimed[email], "551 mailbox moved")])
        # Alice's confirm names the row as she saw it: refused whole, nothing written.
        status, page = await action(alice, c, "/actions/apply", confirm)
        assert status == 409 and "changed since the preview" in page
        row = db.row(email)
        assert (row["status"], row["last_error"], row["resolution"]) == ("dead", "551 mailbox moved", "retried")
        assert first_error != row["last_error"]
        # Previewed again, the same confirm goes through.
        status, page = await action(
            alice,
            c,
            "/actions/preview",
            {"action": "skip", "ids": str(email), "reason": "bad address", "csrf": confirm["csrf"]},
        )
        assert status == 200, page
        again = dict(re.findall(r'name="(ids|versions|reason|action|csrf)" value="([^"]*)"', page))
        status, page = await action(alice, c, "/actions/apply", again)
        assert status == 200, page
    assert (db.row(email)["status"], db.row(email)["resolution"]) == ("done", "skipped")


async def test_a_group_action_over_the_limit_is_refused_before_anything_changes(
    console_factory: Any,
    seeded: tuple[OutboxStore, Seeded],
    db: Db,
    monkeypatch: pytest.MonkeyPatch,
    pg_dsn: str,
    names: OutboxNames,
) -> None:
    _, s = seeded
    monkeypatch.setattr(pages, "ACTION_MAX", len(s.billing) - 1)  # the billing group is one over
    c: RunningConsole = await console_factory()
    billing = group_key(pg_dsn, names, BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
    auth = {"Authorization": f"Bearer {SECRET}"}
    async with client() as session:
        status, page = await action(session, c, "/actions/preview", {"action": "retry", "group": billing}, **auth)
        assert status == 400 and "too many messages for one action from the console" in page
        ids = " ".join(map(str, s.billing))
        status, page = await action(session, c, "/actions/apply", {"action": "retry", "ids": ids}, **auth)
        assert status == 400 and "relay dead retry|skip" in page
    assert all(db.row(oid)["status"] == "dead" for oid in s.billing)


async def test_a_host_it_does_not_answer_to_is_refused_and_reads_nothing(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    """DNS rebinding: another site's name resolving to 127.0.0.1 comes with that name as Host."""
    _, s = seeded
    c: RunningConsole = await console_factory()
    port = c.url.rsplit(":", 1)[1]
    head = s.dead_heads["order-17"]
    for path in ("/", "/dead", f"/messages/{head}", "/aggregate?id=order-17", "/healthz"):
        async with client() as session, session.get(c.url + path, headers={"Host": f"evil.example:{port}"}) as r:
            body = await r.text()
            assert r.status == 403 and "does not answer to the name 'evil.example'" in body, (path, body)
            assert "order-17" not in body and "billing" not in body.lower() and "test" not in body
            assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
    async with client() as session:
        status, _ = await action(
            session, c, "/actions/apply", {"action": "retry", "ids": str(head)},
            Host=f"evil.example:{port}", Authorization=f"Bearer {SECRET}",
        )  # fmt: skip
        assert status == 403 and db.row(head)["status"] == "dead"
        for name in (f"localhost:{port}", f"127.0.0.1:{port}"):
            async with session.get(c.url + "/blocked", headers={"Host": name}) as r:
                assert r.status == 200 and "order-17" in await r.text()
    # Behind a proxy that forwards its own name, --allow-host names it.
    proxied: RunningConsole = await console_factory(allowed_hosts=frozenset({"relay.example.com"}))
    async with client() as session, session.get(proxied.url + "/", headers={"Host": "relay.example.com"}) as r:
        assert r.status == 200


async def test_error_pages_carry_the_security_headers_and_bad_input_is_a_400(
    console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    async with client() as session:
        for path, code in (("/messages/abc", 400), ("/messages/999999999", 404), ("/nowhere", 404)):
            async with session.get(c.url + path) as r:
                assert r.status == code, path
                assert r.headers["Content-Security-Policy"].startswith("default-src 'none'"), path
                assert r.headers["X-Frame-Options"] == "DENY" and r.headers["Cache-Control"] == "no-store", path
        async with session.post(c.url + "/actions/preview", data={}) as r:
            assert r.status == 403 and "Content-Security-Policy" in r.headers
        # A NUL in a skip's reason, or a check value beyond ASCII: refused, not a 500.
        head = s.dead_heads["order-17"]
        form = {"action": "skip", "ids": str(head), "reason": "a\x00b", "token": SECRET}
        status, page = await action(session, c, "/actions/preview", form)
        assert status == 400 and "invalid reason: it contains a NUL" in page
        status, page = await action(session, c, "/actions/preview", {**form, "reason": "ok"})
        assert status == 200, page  # signed in now
        status, page = await action(session, c, "/actions/apply", {**form, "reason": "ok", "csrf": "\u00e9" * 64})
        assert status == 403 and db.row(head)["status"] == "dead"
