"""relay.testing as a user's suite meets it: the pytest plugin, loaded by a conftest.py of
the user's own, in a pytest of its own (pytest-asyncio in strict mode, no setting of this
project's), gives each test a migrated outbox and a relay delivering it; the relay itself
never imports relay.testing or pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

USER_CONFTEST = 'pytest_plugins = ["relay.testing.pytest_plugin"]\n'

USER_TESTS = """
import psycopg
import pytest

from relay import Event


@pytest.mark.asyncio
async def test_written_events_are_delivered(migrated_outbox, running_relay):
    async with await psycopg.AsyncConnection.connect(migrated_outbox.dsn) as conn:
        async with conn.transaction():
            for n in range(3):
                event = Event(aggregate_type="order", aggregate_id="o-1", event_type="OrderPlaced", payload={"n": n})
                await migrated_outbox.outbox.add_async(conn, event)
    delivered = await running_relay.delivered(3)
    assert [m.payload() for m in delivered] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert running_relay.relay.failed is None


@pytest.mark.asyncio
async def test_each_test_has_an_outbox_of_its_own(migrated_outbox):
    assert migrated_outbox.schema.startswith("relay_test_")
    async with await psycopg.AsyncConnection.connect(migrated_outbox.dsn) as conn:
        cur = await conn.execute(f"SELECT count(*) FROM {migrated_outbox.schema}.outbox")
        assert await cur.fetchone() == (0,)
"""

# A module of the user's whose relay delivers to a broker it names.
USER_TESTS_ON_A_BROKER = """
import psycopg
import pytest

from relay import Event


@pytest.fixture
def relay_settings():
    return {"broker": "log", "workers": 1}


@pytest.mark.asyncio
async def test_relay_settings_name_a_broker(migrated_outbox, running_relay):
    async with await psycopg.AsyncConnection.connect(migrated_outbox.dsn) as conn:
        async with conn.transaction():
            event = Event(aggregate_type="order", aggregate_id="o-2", event_type="OrderPaid", payload={})
            await migrated_outbox.outbox.add_async(conn, event)
    assert running_relay.publisher is None
    with pytest.raises(RuntimeError, match="read it from there"):
        await running_relay.delivered(1)
"""


def run_user_suite(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(USER_CONFTEST)
    (tmp_path / "test_orders.py").write_text(textwrap.dedent(USER_TESTS))
    (tmp_path / "test_orders_on_a_broker.py").write_text(textwrap.dedent(USER_TESTS_ON_A_BROKER))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
         "-W", "error::pytest.PytestUnraisableExceptionWarning"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_plugin_gives_a_migrated_outbox_and_a_relay_beside_each_test(pg_dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    proc = run_user_suite(tmp_path, {**env, "RELAY_TEST_DSN": pg_dsn})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout, proc.stdout[-2000:]
    # Every schema the fixtures made is gone.
    with psycopg.connect(pg_dsn) as conn:
        left = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'relay_test_%'").fetchone()
    assert left == (0,)


def test_without_a_database_the_tests_skip_saying_how_to_give_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    proc = run_user_suite(tmp_path, env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "3 skipped" in proc.stdout and "no PostgreSQL for relay.testing's fixtures" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "code",
    [
        "import relay, relay.embed, relay.cli.main",
        "import sys; sys.argv = ['relay', 'start', '--help']\nfrom relay.cli.main import main\ntry:\n    main()\n"
        "except SystemExit:\n    pass",
    ],
    ids=["imports", "help"],
)
def test_the_relay_never_imports_relay_testing_or_pytest(code: str) -> None:
    check = (
        "\nimport sys\nprint(sorted(m for m in sys.modules if m.startswith(('relay.testing', 'pytest', '_pytest'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout
