"""The console in a real browser: Debian's Chromium driven by Playwright, against the
console's app on a loopback port over a real PostgreSQL outbox (and, for the re-drive, a
real `relay start` delivering to a real RabbitMQ).

Each page is saved as a screenshot: into the test's temporary directory, or into
``$RELAY_CONSOLE_SCREENSHOTS`` when set (`make console-screenshots` writes docs/console/).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from relay.db.dispatch import OutboxStore
from relay.db.names import OutboxNames
from tests.conftest import Db
from tests.console_seed import BILLING_500, SECRET, RunningConsole, Seeded
from tests.deliveries import QueueReader
from tests.ops_helpers import group_key
from tests.rabbitmq_broker import AmqpService, Rabbit, relay_args
from tests.relay_process import RelayProcess, wait_until_async
from tests.services import require_services

playwright_api = pytest.importorskip("playwright.async_api")

CHROMIUM = os.environ.get("RELAY_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# As the machine's notes prescribe for a root, headless, offline Chromium: no sandbox, no
# GPU, and none of the background fetches this closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def chromium() -> str:
    if not os.path.exists(CHROMIUM):
        message = f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium chromium-driver; .ci/run does)"
        if require_services():
            pytest.fail(message)
        pytest.skip(message)
    return CHROMIUM


@pytest.fixture
async def page(chromium: str) -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        browser = await p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = await browser.new_context(viewport={"width": 1280, "height": 860})
            yield await context.new_page()
        finally:
            await browser.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("RELAY_CONSOLE_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


async def shoot(page: Any, shots: Path, name: str) -> None:
    path = shots / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000, f"{name}.png is nearly empty"


async def text(page: Any, testid: str) -> str:
    return " ".join((await page.get_by_test_id(testid).inner_text()).split())


async def test_the_overview_shows_the_seeded_counts_and_keeps_them_live(
    page: Any, shots: Path, console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory(refresh_s=0.5)
    response = await page.goto(c.url + "/")
    assert response.status == 200
    assert await text(page, "dead") == str(s.dead) == str(db.statuses()["dead"])
    assert await text(page, "awaiting") == str(len(s.pending))
    assert await text(page, "blocked") == str(len(s.dead_heads))
    # Without a reload: the page's script fetches the figures again (under the console's
    # Content-Security-Policy, which allows its own script only).
    for i in range(6):  # a few rows at a time, so the chart has a slope
        db.insert([(f"late-{i}-{j}", "EmailQueued", {}) for j in range(3)])
        await asyncio.sleep(0.3)
    await page.get_by_test_id("awaiting").filter(has_text=str(len(s.pending) + 18)).wait_for(timeout=10_000)
    # The charts: the console's own samples, drawn as SVG lines.
    assert await page.locator(".chart polyline").count() == 2
    caption = await page.locator(".chart figcaption").first.inner_text()
    assert int(caption.split(" samples")[0].rsplit(" ", 1)[-1]) >= 5, caption
    await shoot(page, shots, "overview")


async def test_the_dead_page_lists_the_seeded_groups_and_their_messages(
    page: Any, shots: Path, console_factory: Any, seeded: tuple[OutboxStore, Seeded], pg_dsn: str, names: OutboxNames
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    await page.goto(c.url + "/dead")
    assert (await text(page, "dead-total")).startswith(f"{s.dead} dead messages in 3 groups")
    billing = group_key(pg_dsn, names, BILLING_500.format(n=1, req="ab12cd34ef56ab78"))
    await shoot(page, shots, "dead")
    await page.get_by_test_id(f"group-{billing}").get_by_role("link").click()
    await page.wait_for_url(f"**/dead/{billing}")
    for oid in s.billing:
        assert await page.get_by_test_id(f"dead-{oid}").count() == 1
    assert await page.locator("[data-testid^=dead-]").count() == len(s.billing)
    await shoot(page, shots, "group")
    await page.goto(c.url + "/blocked")
    assert (await text(page, "blocked-total")).startswith(f"{len(s.dead_heads)} ordered aggregates")
    await shoot(page, shots, "blocked")


async def test_a_retry_from_the_browser_unblocks_the_aggregate_and_the_relay_delivers_it_in_order(
    page: Any,
    shots: Path,
    console_factory: Any,
    seeded: tuple[OutboxStore, Seeded],
    db: Db,
    relay_dsn: str,
    names: OutboxNames,
    rabbit: Rabbit,
    amqp: AmqpService,
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    head, behind = s.dead_heads["order-17"], s.behind["order-17"]
    exchange = await rabbit.exchange("direct")
    queue = await rabbit.queue(bind=(exchange, "outbox"))
    args = [*relay_args(relay_dsn, names, amqp.url), "--exchange", exchange, "--routing-key", "outbox"]
    async with QueueReader(amqp, queue) as reader:
        with RelayProcess("start", *args, "--poll-interval", "200ms") as relay:
            # Everything not held up by a dead head is delivered; order-17 waits behind its head.
            await reader.wait_for(set(s.pending) - {i for ids in s.behind.values() for i in ids}, timeout=30)
            assert not {d.outbox_id for d in reader.got} & set(behind)
            await page.goto(f"{c.url}/messages/{head}")
            assert "the head of its aggregate" in await text(page, "position")
            await shoot(page, shots, "message")
            await page.goto(f"{c.url}/aggregate?id=order-17")
            assert await text(page, "state") == "BLOCKED"
            await shoot(page, shots, "aggregate")
            form = page.get_by_test_id("retry-form")
            await form.get_by_test_id("token").fill(SECRET)
            await form.get_by_test_id("retry-preview").click()
            await page.wait_for_url("**/actions/preview")
            assert (await text(page, "preview-count")).startswith("1 dead message would be re-driven")
            assert db.row(head)["status"] == "dead"  # a preview changes nothing
            await shoot(page, shots, "preview")
            await page.get_by_test_id("confirm").click()
            await page.wait_for_url("**/actions/apply")
            assert (await text(page, "done")).startswith("1 message re-driven")
            await reader.wait_for({head, *behind}, timeout=30)
            # Delivered, and recorded so (the finalize follows the broker's confirm).
            assert await wait_until_async(lambda: db.row(behind[-1])["status"] == "done", timeout=10)
            assert relay.running()
    first = []
    for d in reader.got:
        if d.aggregate_id == "order-17" and d.outbox_id not in first:
            first.append(d.outbox_id)
    # The order the test committed them in: the head, then its followers one by one.
    assert first == [head, *behind]
    assert db.row(head)["resolved_by"] == "alice"


async def test_an_action_without_the_token_is_refused_and_changes_nothing(
    page: Any, shots: Path, console_factory: Any, seeded: tuple[OutboxStore, Seeded], db: Db
) -> None:
    _, s = seeded
    c: RunningConsole = await console_factory()
    head = s.dead_heads["order-23"]
    before = db.row(head)
    await page.goto(f"{c.url}/messages/{head}")
    form = page.get_by_test_id("retry-form")
    await form.get_by_test_id("token").fill("not-the-token-at-all")
    async with page.expect_response(lambda r: r.url.endswith("/actions/preview")) as answer:
        await form.get_by_test_id("retry-preview").click()
    assert (await answer.value).status == 403
    assert "an action needs the console's token" in await text(page, "error")
    await shoot(page, shots, "refused")
    # Straight to the confirm step with nothing: refused as well.
    response = await page.request.post(f"{c.url}/actions/apply", form={"action": "retry", "ids": str(head)})
    assert response.status == 403
    assert db.row(head) == before
