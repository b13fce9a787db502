"""No password from the DSN reaches stdout, stderr or a log line, in any operator command,
whether the database answers or not."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import quote

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.db.dispatch import OutboxStore
from relay.ordering import OrderingMap
from tests.conftest import Db
from tests.ops_helpers import build_scene, run_parallel
from tests.relay_process import assert_one_line_error

MakeStore = Callable[..., Awaitable[OutboxStore]]

# The local test server trusts its clients, so a DSN carrying a password still connects:
# every command runs its full path with the password in hand.
PASSWORD = "Pw-s3cret-4711"
UNREACHABLE = f"postgresql://alice:{PASSWORD}@127.0.0.1:1/orders"


def with_password(dsn: str) -> tuple[str, str]:
    """``dsn`` with PASSWORD added, in keyword form and in URL form."""
    keywords = make_conninfo(dsn, password=PASSWORD)
    p = conninfo_to_dict(dsn)
    url = (
        f"postgresql://{quote(str(p.get('user') or 'postgres'))}:{PASSWORD}@{p.get('host') or '127.0.0.1'}"
        f":{p.get('port') or 5432}/{p.get('dbname') or 'postgres'}"
    )
    return keywords, url


def commands(schema: str, dead_id: int) -> list[list[str]]:
    """Every operator command, with the flags that make it print the most."""
    return [
        ["status", "--by-event-type"],
        ["status", "--json", "--by-event-type"],
        ["explain", "a"],
        ["dead", "list"],
        ["dead", "list", "--group", "--json"],
        ["dead", "retry", str(dead_id), "--dry-run"],
        ["dead", "skip", str(dead_id), "--reason", "test", "--dry-run"],
        ["dead", "retry", "999999"],  # refused: an error path with a live database
        ["prune", "--older-than", "7d", "--dry-run"],
    ]


async def test_no_password_in_any_output_when_the_database_answers(
    make_store: MakeStore, db: Db, relay_dsn: str
) -> None:
    scene = await build_scene(await make_store(OrderingMap(default_ordered=True, unordered=("Email*",))), db)
    keywords, url = with_password(relay_dsn)
    every = commands(db.names.schema, scene.a[0])
    debug = ["--schema", db.names.schema, "--log-level", "debug"]
    runs = [[*c, "--dsn", keywords, *debug, "--log-format", "json"] for c in every]
    runs += [[*c, "--dsn", url, *debug, "--log-format", "text"] for c in every[::2]]  # URL form: a sample suffices
    for args, proc in zip(runs, run_parallel(*runs), strict=True):
        refused = args[:3] == ["dead", "retry", "999999"]
        assert proc.returncode == (2 if refused else 0), (args, proc.stderr)
        assert PASSWORD not in proc.stdout + proc.stderr, args
        assert refused or proc.stdout.strip(), args  # it did print its report


def test_no_password_in_any_output_when_the_database_is_unreachable() -> None:
    runs = [[*command, "--dsn", UNREACHABLE] for command in commands("public", 1)]
    for args, proc in zip(runs, run_parallel(*runs), strict=True):
        assert_one_line_error(proc, "cannot connect to PostgreSQL at host 127.0.0.1:1 database 'orders'")
        assert PASSWORD not in proc.stdout + proc.stderr, args
