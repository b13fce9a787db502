"""Careless mistakes get what the CLI already gives (issue 38 item 14): one line naming the
fix, a did-you-mean for a misspelt name, refusal of a setting that belongs to another
destination, a warning for a RELAY_* variable nothing reads, a Unix socket described as
one, and install instructions that work where the package index lacks the project."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import logging
import re
import tomllib
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay import ConfigError, Event, Outbox, Relay, to_json
from relay.db.names import OutboxNames
from relay.dsn import describe_dsn
from tests.conftest import Db
from tests.helpers import sqlalchemy_url
from tests.relay_process import assert_one_line_error, relay_env, run_relay, wait_until_async

ROOT = Path(__file__).resolve().parent.parent
# A database nobody answers for: a command that gets past its checks fails fast on it.
NOWHERE = "postgresql://relay@127.0.0.1:1/orders"


# ---- Outbox.add on a database that was never migrated


def test_outbox_add_on_an_unmigrated_database_says_to_run_migrate(scratch_dsn: str) -> None:
    """Before: a bare psycopg.errors.UndefinedTable ("relation "public.outbox" does not exist")."""
    with psycopg.connect(scratch_dsn) as conn:
        with pytest.raises(ConfigError) as raised:
            Outbox().add(conn, Event("order", "A", "OrderPlaced", {}))
        conn.rollback()
        with pytest.raises(ConfigError, match=r"^outbox sales\.events does not exist"):
            Outbox("events", "sales").add_many(conn, [Event("order", "A", "E", {}), Event("order", "A", "E", {})])
    line = str(raised.value)
    assert line == (
        "outbox public.outbox does not exist in this database: run `relay migrate`"
        " (with --schema and --table as given to Outbox) first"
    )
    assert isinstance(raised.value.__cause__, psycopg.errors.UndefinedTable)


async def test_the_same_line_from_asyncio_and_sqlalchemy(scratch_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(scratch_dsn) as conn:
        with pytest.raises(ConfigError, match="run `relay migrate`"):
            await Outbox().add_async(conn, Event("order", "A", "OrderPlaced", {}))
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(sqlalchemy_url(scratch_dsn))
    try:
        # SQLAlchemy wraps the driver's error in its own ProgrammingError (``orig``).
        with Session(engine) as session, pytest.raises(ConfigError, match="run `relay migrate`"):
            Outbox().add(session, Event("order", "A", "OrderPlaced", {}))
    finally:
        engine.dispose()


# ---- payloads: the path to what cannot be encoded, and no naive datetime


class Money:
    def __init__(self, amount: str) -> None:
        self.amount = decimal.Decimal(amount)


@dataclasses.dataclass
class Line:
    sku: str
    price: Any


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        ({"lines": [Line("x", Money("1.10"))]}, TypeError, "payload['lines'][0].price: cannot encode Money as JSON"),
        ({"total": Money("2")}, TypeError, "payload['total']: cannot encode Money as JSON"),
        ([{"a": 1}, {"b": {1.5, 2.5}}], TypeError, "payload[1]['b']: cannot encode set as JSON"),
        ({"ok": 1, "x": [0.5, float("nan")]}, ValueError, "payload['x'][1]: Out of range float values"),
        ({"by": {(1, 2): "pair"}}, TypeError, "payload['by'], the key (1, 2): keys must be str"),
        (Money("3"), TypeError, "payload: cannot encode Money as JSON"),
    ],
)
def test_an_encoding_error_names_the_path_to_the_value(payload: Any, error: type[Exception], message: str) -> None:
    """Before: ``cannot encode Money as JSON`` with no hint of which of a payload's values it was."""
    with pytest.raises(error) as raised:
        to_json(payload)
    assert str(raised.value).startswith(message), str(raised.value)


def test_a_circular_or_too_deep_payload_gets_one_line() -> None:
    loop: list[Any] = []
    loop.append({"again": loop})
    with pytest.raises(ValueError, match=r"^payload\[0\]\['again'\] \(a circular reference\): Circular"):
        to_json(loop)
    deep: dict[str, Any] = {}
    for _ in range(100_000):
        deep = {"d": deep}
    with pytest.raises(ValueError, match=r"^payload: nested too deeply to encode as JSON$"):
        to_json(deep)


def test_a_naive_datetime_is_refused_and_an_aware_one_kept() -> None:
    """Before: ``datetime(2026, 12, 3, 10, 0)`` was stored as "2026-12-03T10:00:00", which a
    consumer reads as UTC or as its own local time."""
    naive = dt.datetime(2026, 12, 3, 10, 0)
    with pytest.raises(TypeError, match=r"^payload\['placed'\]: a datetime without a time zone names no instant"):
        to_json({"placed": naive})

    @dataclasses.dataclass
    class Placed:
        at: dt.datetime

    with pytest.raises(TypeError, match=r"^payload\.at: a datetime without a time zone"):
        to_json(Placed(naive))
    aware = naive.replace(tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert to_json({"placed": aware, "day": naive.date(), "opens": dt.time(9, 0)}) == (
        '{"placed":"2026-12-03T10:00:00+01:00","day":"2026-12-03","opens":"09:00:00"}'
    )


def test_nothing_is_written_when_a_payload_is_refused(db: Db, names: OutboxNames, producer_dsn: str) -> None:
    with psycopg.connect(producer_dsn) as conn:
        with pytest.raises(TypeError, match=r"^payload\['at'\]: a datetime without a time zone"):
            Outbox(names.table, names.schema).add(conn, Event("order", "A", "E", {"at": dt.datetime(2026, 1, 1)}))
        conn.commit()
    assert db.rows() == []


# ---- settings: did-you-mean, another destination's settings, unknown variables


def test_a_misspelt_relay_setting_gets_a_did_you_mean() -> None:
    """Before: ``unknown relay setting 'worker'`` and nothing more, where the CLI offers --workers."""
    with pytest.raises(ConfigError, match=r"^unknown relay setting 'worker' \(did you mean 'workers'\?\)"):
        Relay(worker=2)
    with pytest.raises(ConfigError, match=r"\(did you mean 'batch_size' or 'batch_bytes'\?\)"):
        Relay(batch=2)
    with pytest.raises(ConfigError, match=r"^unknown relay setting 'frobnicate': the settings are"):
        Relay(frobnicate=2)


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (
            ["--broker", "rabbitmq", "--amqp-url", "amqp://guest:guest@127.0.0.1/", "--queue-url", "https://q"],
            {},
            "--queue-url is a setting of --broker sqs, not of --broker rabbitmq: remove it, or choose --broker sqs",
        ),
        (
            ["--broker", "rabbitmq", "--amqp-url", "amqp://guest:guest@127.0.0.1/"],
            {"RELAY_QUEUE_URL": "https://q"},
            "RELAY_QUEUE_URL (--queue-url) is a setting of --broker sqs, not of --broker rabbitmq: unset it",
        ),
        (["--broker", "log", "--amqp-url", "amqp://u:pw@h/"], {}, "--amqp-url is a setting of --broker rabbitmq"),
        (
            ["--broker", "log"],
            {"RELAY_REGION": "eu-west-1"},
            "RELAY_REGION (--region) is a setting of --broker sns or --broker sqs, not of --broker log",
        ),
    ],
)
def test_start_refuses_a_setting_of_another_destination(args: list[str], env: dict[str, str], needle: str) -> None:
    """Before: --queue-url with --broker rabbitmq was accepted and ignored."""
    proc = run_relay("start", "--dsn", NOWHERE, *args, env=relay_env(**env))
    assert_one_line_error(proc, needle)


def test_replay_and_the_python_api_refuse_it_too_and_the_config_file_may_hold_every_broker(tmp_path: Path) -> None:
    proc = run_relay("replay", "--dsn", NOWHERE, "--broker", "log", "--from-id", "1", "--exchange", "orders")
    assert_one_line_error(proc, "--exchange is a setting of --broker rabbitmq, not of --broker log")
    with pytest.raises(ConfigError, match=r"^--queue-url is a setting of --broker sqs, not of --broker rabbitmq"):
        Relay(dsn=NOWHERE, broker="rabbitmq", amqp_url="amqp://guest:guest@h/", queue_url="https://q")
    with pytest.raises(ConfigError, match=r"^RELAY_EXCHANGE \(--exchange\) is a setting of --broker rabbitmq"):
        Relay(dsn=NOWHERE, broker="log", environ={"RELAY_EXCHANGE": "orders"})
    # SQS and SNS share a relay through routes: each takes the other's settings.
    Relay(dsn=NOWHERE, broker="sqs", queue_url="https://sqs.eu-west-1.amazonaws.com/1/q", topic_arn="arn:x")
    # One file for several relays, each choosing its broker: only the chosen table is read.
    config = tmp_path / "relay.toml"
    config.write_text('[sqs]\nqueue_url = "https://sqs.eu-west-1.amazonaws.com/1/q"\n[rabbitmq]\nexchange = "x"\n')
    Relay(dsn=NOWHERE, broker="log", config=str(config))


def test_a_misspelt_variable_is_warned_about_with_the_name_it_resembles(tmp_path: Path) -> None:
    """Before: RELAY_WORKER=3 was ignored without a word, and the relay ran 4 workers."""
    proc = run_relay("status", "--dsn", NOWHERE, env=relay_env(RELAY_WORKER="3", RELAY_SCHEME="sales"))
    assert proc.returncode == 2
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert [w.split(": ", 1)[1] for w in warnings] == [
        "RELAY_SCHEME is set, but no setting of the relay has that name: it is ignored (did you mean RELAY_SCHEMA?)",
        "RELAY_WORKER is set, but no setting of the relay has that name: it is ignored (did you mean RELAY_WORKERS?)",
    ]
    assert "sales" not in proc.stderr  # a value is never shown: it may be a secret
    relay = Relay(dsn=NOWHERE, broker="log", environ={"RELAY_WORKER": "3", "RELAY_TEST_DSN": "x"})
    assert relay.settings.workers == 4
    assert relay.settings.warnings == (
        "RELAY_WORKER is set, but no setting of the relay has that name: it is ignored (did you mean RELAY_WORKERS?)",
    )


async def test_relay_start_logs_the_unknown_variable_when_it_starts(
    relay_dsn: str, names: OutboxNames, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    environ = {"RELAY_DSN": relay_dsn, "RELAY_SCHEMA": names.schema, "RELAY_BROKER": "log", "RELAY_WORKER": "3"}
    async with Relay(environ=environ):
        assert await wait_until_async(lambda: "relay started" in caplog.text)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING and "RELAY_WORKER" in r.getMessage()]
    assert "did you mean RELAY_WORKERS?" in warning.getMessage()


def test_every_variable_a_command_reads_is_known() -> None:
    from relay.cli.common import ALL_OPTIONS, KNOWN_VARIABLES
    from relay.cli.console import TOKEN_ENV
    from relay.operator_options import OPERATOR_OPTIONS
    from relay.wiring import VARIABLES

    # What the commands warn with; a command-line-only option reads no variable.
    assert {o.env for o in ALL_OPTIONS if o.reads_env} | {TOKEN_ENV, "RELAY_CONFIG"} <= KNOWN_VARIABLES
    assert not {o.env for o in ALL_OPTIONS if o.cli_only} & KNOWN_VARIABLES
    # relay start's own (and the grants'), as relay.wiring knows them.
    operators = {o.env for o in OPERATOR_OPTIONS}
    assert {o.env for o in ALL_OPTIONS if o.reads_env} - operators | {TOKEN_ENV, "RELAY_CONFIG"} <= VARIABLES


def test_relay_start_knows_the_operator_commands_variables() -> None:
    # RELAY_CONSOLE_PORT in relay start's environment (one env file for a deployment) is
    # read by relay console: "no setting of the relay has that name" would be untrue.
    from relay.operator_options import OPERATOR_OPTIONS
    from relay.wiring import VARIABLES

    assert {o.env for o in OPERATOR_OPTIONS if o.reads_env} <= VARIABLES


# ---- a Unix-socket DSN


def test_a_unix_socket_dsn_is_described_as_its_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``dbname=app`` (libpq's default socket) was described as ``host localhost:5432``,
    and ``host=/var/run/postgresql`` as ``host /var/run/postgresql:5432``."""
    monkeypatch.delenv("PGHOST", raising=False)
    monkeypatch.delenv("PGHOSTADDR", raising=False)
    monkeypatch.delenv("PGPORT", raising=False)
    assert describe_dsn("dbname=app user=relay") == (
        "socket .s.PGSQL.5432 (libpq's default directory) database 'app' user 'relay'"
    )
    assert (
        describe_dsn("postgresql:///app?port=6432") == "socket .s.PGSQL.6432 (libpq's default directory) database 'app'"
    )
    assert describe_dsn("host=/var/run/postgresql dbname=app") == (
        "socket /var/run/postgresql/.s.PGSQL.5432 database 'app'"
    )
    assert (
        describe_dsn("postgresql://relay@%2Ftmp%2F:5433/app") == "socket /tmp/.s.PGSQL.5433 database 'app' user 'relay'"
    )
    assert describe_dsn("host=/tmp,db.example port=5433 dbname=app") == (
        "servers /tmp/.s.PGSQL.5433,db.example:5433 database 'app'"
    )
    monkeypatch.setenv("PGHOST", "/run/pg")
    assert describe_dsn("dbname=app") == "socket /run/pg/.s.PGSQL.5432 database 'app'"


def test_the_error_and_relay_status_name_the_socket(pg_dsn: str, db: Db) -> None:
    proc = run_relay("status", "--dsn", "host=/nonexistent/dir port=5499 dbname=orders user=relay")
    assert_one_line_error(
        proc, "cannot connect to PostgreSQL at socket /nonexistent/dir/.s.PGSQL.5499 database 'orders' user 'relay'"
    )
    proc = run_relay("status", "--dsn", "port=1 dbname=orders user=relay", env={**relay_env(), "PGHOST": ""})
    assert_one_line_error(proc, "cannot connect to PostgreSQL at socket .s.PGSQL.1 (libpq's default directory)")

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('unix_socket_directories')").fetchone()
    directory = (row[0] if row else "").split(",")[0].strip()
    params = conninfo_to_dict(pg_dsn)
    if not directory.startswith("/") or params.get("host", "127.0.0.1") not in ("127.0.0.1", "localhost", "::1"):
        pytest.skip("the test server has no Unix socket on this machine")
    socket_dsn = make_conninfo(pg_dsn, host=directory)
    proc = run_relay("status", "--dsn", socket_dsn, "--schema", db.names.schema)
    if proc.returncode != 0 and "authentication" in proc.stderr:
        pytest.skip(f"the test server refuses socket logins: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    port = params.get("port", "5432")
    assert f"socket {directory.rstrip('/')}/.s.PGSQL.{port} database" in proc.stdout, proc.stdout
    assert "localhost" not in proc.stdout


# ---- installing


def _version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_install_lines_say_how_to_install_from_a_clone_or_a_wheel(page: str) -> None:
    """Before: only ``pip install 'outbox-relay[sqs]'``, which fails where the index lacks the project."""
    text = (ROOT / page).read_text()
    assert "pip install '.[sqs]'" in text  # from a clone
    assert "pip wheel --no-deps . -w dist" in text
    assert f"pip install './dist/outbox_relay-{_version()}-py3-none-any.whl[sqs]'" in text


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "Containerfile", ROOT / "Makefile", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_docker_build_command_names_the_containerfile() -> None:
    """Before: ``docker build -t outbox-relay .``, which looks for a Dockerfile and finds none."""
    commands = [
        (path.name, match.group(0))
        for path in _doc_files()
        for match in re.finditer(r"docker build\b[^`\n#]*\s\.(?=[\s`]|$)", path.read_text())
    ]
    assert len(commands) >= 3, commands
    assert [c for c in commands if "-f Containerfile" not in c[1]] == []


def test_where_the_extras_are_listed_all_is_said_to_be_the_brokers_only() -> None:
    """[all] installs every broker's SDK, not the console or OpenTelemetry: each page that
    offers [all] says so."""
    pages = [path for path in _doc_files() if path.suffix == ".md" and "or [all]" in path.read_text()]
    assert {p.name for p in pages} >= {"README.md", "install.md"}
    for page in pages:
        text = page.read_text()
        assert "`console` and `otel` are" in text and "outbox-relay[all,console,otel]" in text, page
    # What the pages say is still so: [all] holds neither the console's jinja2 nor OpenTelemetry.
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not [dep for dep in extras["all"] if dep.startswith(("jinja2", "opentelemetry"))]
