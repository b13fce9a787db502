"""Careless and hostile input (issue 17): one line on stderr, exit code 2, never a traceback.

Every case runs the real console script as a subprocess; the bounds underneath are tested
unit by unit in test_bounds.py.
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relay.db.dispatch import OutboxStore
from tests.conftest import Db
from tests.ops_helpers import claim_until, kill, target
from tests.relay_process import RELAY, assert_one_line_error, relay_env, run_relay

# Nothing below needs a database to be refused; this one is never reached.
NO_DB = "postgresql://nobody@127.0.0.1:1/never"
# Digits Python's int() and float() accept, or str.isdigit() does, that are not ASCII.
ARABIC_ONE = "\u0661"  # int() reads it as 1
SUPERSCRIPT_TWO = "\u00b2"  # isdigit() says yes, int() raises ValueError
FULLWIDTH_ONE = "\uff11"


def run_capped(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``relay ARGS`` with its address space capped at 1 GiB, so that a regression that reads
    ``/dev/zero`` to the end fails this test instead of taking the machine's memory."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run(
        [RELAY, *args], capture_output=True, text=True, timeout=timeout, env=env or relay_env(), preexec_fn=cap
    )


# ---- relay start: durations, numbers and names, from flags, variables and the file

START = ["start", "--broker", "log", "--dsn", NO_DB]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--lease", "inf"], "invalid --lease: 'inf'"),
        (["--lease", "nan"], "invalid --lease: 'nan'"),
        (["--lease", "1e300"], "invalid --lease: '1e300'"),
        (["--lease", "99999999999d"], "must be at most 1d"),
        (["--lease", "99999d"], "must be at most 1d"),
        (["--lease", "9" * 5000], "invalid --lease"),
        (["--lease", ARABIC_ONE + "s"], "invalid --lease"),
        (["--lease", "1_0"], "invalid --lease"),
        (["--lease", "5ms", "--publish-timeout", "1ms"], "must be at least"),
        (["--publish-timeout", "1ms"], "invalid --publish-timeout: '1ms' (must be at least 10ms)"),
        (["--poll-interval", "0"], "invalid --poll-interval: '0' (must be at least 10ms)"),
        (["--prune-older-than", "7d", "--prune-interval", "0s"], "--prune-interval: '0s' (must be at least 1s)"),
        (["--prune-older-than", "inf"], "invalid --prune-older-than"),
        (["--prune-older-than", "0s"], "must be at least 1m"),
        (["--backoff-base", "0s"], "invalid --backoff-base"),
        (["--backoff-cap", "2d"], "must be at most 1d"),
        (["--shutdown-grace", "1e300"], "invalid --shutdown-grace"),
        (["--defer-max-age", "400d"], "must be at most 365d"),
        (["--workers", "1_0"], "invalid --workers: '1_0' (expected an integer)"),
        (["--workers", ARABIC_ONE], "invalid --workers"),
        (["--workers", SUPERSCRIPT_TWO], "invalid --workers"),
        (["--workers", "4.9"], "invalid --workers: '4.9' (expected an integer)"),
        (["--workers", "9" * 5000], "invalid --workers"),
        (["--table", ""], "invalid --table: must not be empty"),
        (["--schema", ""], "invalid --schema: must not be empty"),
        (["--table", "t" * 100_000], "longer than 40 characters"),  # argv takes at most 128 KiB
        (["--schema", "s" * 40, "--table", "t" * 40], "wake-up channel"),
        (["--metrics-host", ""], "invalid --metrics-host: must not be empty"),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else None,
)
def test_start_refuses_bad_flags(flags: list[str], needle: str) -> None:
    assert_one_line_error(run_relay(*START, *flags, timeout=20), needle)


@pytest.mark.parametrize(
    ("variables", "needle"),
    [
        ({"RELAY_LEASE": "nan"}, "invalid --lease (from RELAY_LEASE): 'nan'"),
        ({"RELAY_LEASE": "inf"}, "invalid --lease (from RELAY_LEASE)"),
        ({"RELAY_WORKERS": "1_0"}, "invalid --workers (from RELAY_WORKERS)"),
        ({"RELAY_TABLE": ""}, "invalid --table (from RELAY_TABLE): must not be empty"),
        ({"RELAY_SCHEMA": ""}, "invalid --schema (from RELAY_SCHEMA): must not be empty"),
    ],
)
def test_start_refuses_bad_variables(variables: dict[str, str], needle: str) -> None:
    assert_one_line_error(run_relay(*START, env=relay_env(**variables)), needle)


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("lease = inf", "invalid --lease (from config lease): inf"),
        ("lease = nan", "invalid --lease (from config lease)"),
        ("lease = 1e300", "invalid --lease (from config lease)"),
        ("lease = 2020-01-01", "invalid --lease (from config lease): datetime.date(2020, 1, 1)"),
        ("lease = [1]", "invalid --lease (from config lease): [1]"),
        ("lease = {a = 1}", "invalid --lease (from config lease)"),
        ('lease = "99999999999d"', "must be at most 1d"),
        ("workers = 4.9", "invalid --workers (from config workers): 4.9 (expected an integer)"),
        ("workers = 1e400", "invalid --workers (from config workers): inf (expected an integer)"),
        ('workers = "1_0"', "invalid --workers (from config workers)"),
        ('table = ""', "invalid --table (from config table): must not be empty"),
        ('schema = ""', "invalid --schema (from config schema): must not be empty"),
        (f'table = "{"t" * 1_000_000}"', "longer than 40 characters"),
        (f"{'k' * 100_000} = 1", "unknown key"),
        ("ordered = " + "[" * 50_000 + "]" * 50_000, "nested too deeply"),
        ("ordered = " + "{a = " * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ],
    ids=lambda v: v[:40] if isinstance(v, str) else None,
)
def test_start_refuses_bad_config_values(toml: str, needle: str, tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text(toml + "\n")
    # The 1,000,000-character table name used to spin for ten minutes.
    started = time.monotonic()
    assert_one_line_error(run_relay(*START, "--config", str(config), timeout=30), needle)
    assert time.monotonic() - started < 15


def test_config_that_is_not_a_file_of_text(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    big.write_bytes(b" " * (1024 * 1024 + 1))  # valid TOML (blank), but no config is that big
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b'table = "\xff\xfe"\n')
    assert_one_line_error(run_capped(*START, "--config", "/dev/zero"), "config file /dev/zero is larger than 1024 KiB")
    assert_one_line_error(run_capped(*START, "--config", str(big)), "is larger than 1024 KiB")
    assert_one_line_error(run_capped(*START, "--config", str(binary)), "not UTF-8 text")


# ---- operator commands


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["status", "--watch", "--interval", "1e300"], "invalid --interval: '1e300'"),
        (["status", "--watch", "--interval", "inf"], "invalid --interval: 'inf'"),
        (["status", "--watch", "--interval", "10ms"], "(must be at least 100ms)"),
        (["status", "--watch", "--interval", "2h"], "(must be at most 1h)"),
        (["prune", "--older-than", "inf"], "invalid --older-than: 'inf'"),
        (["prune", "--older-than", "nan"], "invalid --older-than: 'nan'"),
        (["prune", "--older-than", "1e300"], "invalid --older-than: '1e300'"),
        (["prune", "--older-than", "99999999999d"], "(must be at most 36500d)"),
        (["prune", "--older-than", "7d", "--chunk-size", "1_0"], "Invalid value for '--chunk-size'"),
        (["dead", "list", "--newer-than", "0001-01-01T00:00"], "out of range in the local time zone"),
        (["dead", "list", "--newer-than", "99999999d"], "(must be at most 36500d)"),
        (["dead", "list", "--newer-than", "inf"], "invalid --newer-than: 'inf'"),
        (["dead", "list", "--older-than", "nan"], "invalid --older-than: 'nan'"),
        (["dead", "list", "--limit", "1_0"], "Invalid value for '--limit'"),
        (["dead", "list", "--limit", ARABIC_ONE], "Invalid value for '--limit'"),
        (["dead", "retry", SUPERSCRIPT_TWO], "invalid id"),
        (["dead", "retry", "99999999999999999999"], "invalid id"),
        (["dead", "skip", "--reason", "x", FULLWIDTH_ONE], "invalid id"),
        (["dead", "retry", "--group", "x" * 100_000], "invalid --group 'xxx"),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else "",
)
def test_operator_commands_refuse_bad_arguments(args: list[str], needle: str) -> None:
    # Refused before any connection: the database named here does not exist.
    assert_one_line_error(run_relay(*args, "--dsn", NO_DB, timeout=20), needle)


async def test_ids_in_other_scripts_touch_nothing(store: OutboxStore, db: Db, relay_dsn: str) -> None:
    """`dead retry \u0661` (an Arabic-Indic one) used to be read as id 1 and re-drive row 1."""
    [first] = db.insert([("agg", "OrderPlaced", {})])
    assert first == 1  # a fresh table: the row the Arabic-Indic one would have named
    claimed = await claim_until(store, {first})
    await kill(store, [claimed[first]], "PermanentError: refused")
    before = db.row(first)
    assert before["status"] == "dead"
    t = target(relay_dsn, db)
    for args in (
        ["dead", "retry", ARABIC_ONE],
        ["dead", "retry", SUPERSCRIPT_TWO],
        ["dead", "retry", "1_0"],
        ["dead", "skip", "--reason", "x", ARABIC_ONE],
        ["dead", "retry", "1", ARABIC_ONE],  # one good id does not let the bad one through
    ):
        assert_one_line_error(run_relay(*args, *t), "invalid id")
    assert db.row(first) == before


def test_explain_refuses_text_the_database_cannot_take(db: Db, relay_dsn: str) -> None:
    # Bytes that are not UTF-8 in argv arrive as lone surrogates.
    bad = "order-\udcff"
    assert_one_line_error(run_relay("explain", *target(relay_dsn, db), bad), "invalid AGGREGATE_ID: not UTF-8 text")
    assert_one_line_error(run_relay("dead", "list", *target(relay_dsn, db), "--aggregate", bad), "invalid --aggregate")
    assert_one_line_error(run_relay("explain", *target(relay_dsn, db), "x" * 10_000), "(10,000 characters) not found")


# ---- the metrics endpoint


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_metrics_port_in_use_or_host_unknown(db: Db, relay_dsn: str, taken_port: int) -> None:
    """The bind fails inside asyncio.run; its ConfigError still becomes the one line."""
    common = ["start", "--broker", "log", *target(relay_dsn, db), "--log-level", "error"]
    assert_one_line_error(
        run_relay(*common, "--metrics-port", str(taken_port), "--metrics-host", "127.0.0.1"),
        f"cannot serve metrics on '127.0.0.1' port {taken_port}",
    )
    assert_one_line_error(
        run_relay(*common, "--metrics-port", "0", "--metrics-host", "no-such-host.invalid"),
        "cannot serve metrics on 'no-such-host.invalid' port 0",
    )


# ---- the last-resort handler

# Python run as the console script would run, with one function made to fail as a bug would.
FAILING = """
import sys
import relay.cli.common
from relay.cli.main import main

def broken(path):
    raise {exc}

relay.cli.common.load_file = broken
main(sys.argv[1:])
"""


def run_failing(exc: str, *args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", FAILING.format(exc=exc), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=relay_env(**variables),
    )


BUG = "RuntimeError('boom at postgresql://relay:Secret55@db/app' + chr(10) + 'second line ' + 'x' * 5000)"


def test_unexpected_errors_are_one_line_with_a_hint() -> None:
    proc = run_failing(BUG, "status", "--dsn", NO_DB)
    line = assert_one_line_error(
        proc, "unexpected error: RuntimeError: boom at", "rerun with --log-level debug", code=1
    )
    assert "Secret55" not in proc.stderr and "second line" not in line


@pytest.mark.parametrize(
    ("args", "variables"),
    [
        (["status", "--dsn", NO_DB, "--log-level", "debug"], {}),
        (["status", "--dsn", NO_DB, "--log-level=debug"], {}),
        (["status", "--dsn", NO_DB], {"RELAY_LOG_LEVEL": "debug"}),
    ],
)
def test_debug_level_shows_the_traceback(args: list[str], variables: dict[str, str]) -> None:
    proc = run_failing(BUG, *args, **variables)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "in broken" in proc.stderr
    assert "Secret55" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("relay: unexpected error: RuntimeError: boom at")


def test_interrupt_still_exits_130() -> None:
    proc = run_failing("KeyboardInterrupt()", "status", "--dsn", NO_DB)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr


# ---- what --help says


def test_help_shows_the_bounds() -> None:
    proc = run_relay("start", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    for needle in ("[1s..1d]", "[10ms..1h]", "[1..256]", "[1m..36500d]"):
        assert needle in text, needle
