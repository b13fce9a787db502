"""Bounds and types of every setting, unit by unit (issue 17); the CLI cases, as
subprocesses, are in test_bad_input.py."""

from __future__ import annotations

import math
import time
from datetime import date, timedelta
from pathlib import Path
from typing import Any

import pytest

from relay.cli.common import ALL_OPTIONS, AsciiInt
from relay.config import CORE_OPTIONS, OPERATE_OPTIONS, START_OPTIONS
from relay.db.names import OutboxNames
from relay.durations import MAX_DURATION, parse_duration
from relay.errors import ConfigError
from relay.options import MAX_CONFIG_BYTES, load_file, resolve
from relay.runner import Operations

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "cli.md"
OPTIONS = (*CORE_OPTIONS, *START_OPTIONS, *OPERATE_OPTIONS)
ARABIC_ONE = "\u0661"  # int() and float() read it as 1
SUPERSCRIPT_TWO = "\u00b2"  # str.isdigit() says yes, int() raises ValueError


# ---- what the generated reference says


def test_reference_lists_every_bound() -> None:
    # docs/reference/cli.md is generated (scripts/docs_reference.py); each setting's row
    # carries an anchor named after it, and test_docs_reference.py keeps the page current.
    lines = REFERENCE.read_text(encoding="utf-8").splitlines()
    bounded = [o for o in ALL_OPTIONS if o.bounds]
    assert len(bounded) >= 15
    for o in bounded:
        anchor = '<a id="opt-' + o.dest.replace("_", "-") + '"></a>'
        rows = [line for line in lines if anchor in line]
        assert len(rows) == 1, f"{o.flag} has no row in docs/reference/cli.md: run make docs-reference"
        assert f"`{o.bounds}`" in rows[0], (o.flag, o.bounds, rows[0])


def test_every_number_and_duration_is_bounded() -> None:
    for o in ALL_OPTIONS:
        if o.kind in ("int", "float", "duration"):
            assert o.minimum is not None, o.flag
            if o.kind == "duration":
                assert o.maximum is not None, o.flag
            if o.default is not None:
                o.parse(o.default, "default")  # every default is inside its own bounds


# ---- durations, unit by unit


@pytest.mark.parametrize(
    "bad",
    [
        "inf",
        "nan",
        "-inf",
        "1e300",
        "1e3",
        "99999999999d",
        "9" * 100_000,
        ARABIC_ONE,
        SUPERSCRIPT_TWO,
        "1_0",
        "+5",
        "0x10",
        "1.",
        ".5s",
        "5s5",
        math.inf,
        math.nan,
        1e300,
        -1,
        timedelta.max,
        date(2020, 1, 1),
        [1],
        {"a": 1},
        None,
        True,
    ],
    ids=lambda v: repr(v)[:20],
)
def test_durations_refused(bad: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"^invalid --lease: ") as info:
        parse_duration(bad, name="--lease")
    assert time.monotonic() - started < 1
    assert "\n" not in str(info.value) and len(str(info.value)) < 200


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30), ("1m30s", 90), ("1.5", 1.5), ("2H", 7200), (" 7 d ", 604800), ("36500d", 3153600000)],
)
def test_durations_accepted(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


def test_duration_bounds() -> None:
    assert parse_duration("36500d") == MAX_DURATION
    with pytest.raises(ConfigError, match=r"must be at most 36500d"):
        parse_duration("36501d", name="--lease")
    with pytest.raises(ConfigError, match=r"^invalid --x: '5ms' \(must be at least 1s\)$"):
        parse_duration("5ms", name="--x", minimum=timedelta(seconds=1))
    with pytest.raises(ConfigError, match=r"\(must be at most 1h\)$"):
        parse_duration(3601, name="--x", maximum=timedelta(hours=1))
    with pytest.raises(ConfigError, match="must not be negative"):
        parse_duration("-3s", name="--x")
    assert parse_duration("1h", minimum=timedelta(seconds=1), maximum=timedelta(hours=1)) == timedelta(hours=1)


# ---- Option.parse and resolve


def _resolve(cli: dict[str, Any] | None = None, file: dict[str, Any] | None = None, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return resolve(OPTIONS, cli or {}, file or {}, env or {})


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"file": {"workers": 4.9}}, r"invalid --workers \(from config workers\): 4\.9 \(expected an integer\)"),
        ({"file": {"workers": 4.0}}, r"expected an integer"),
        ({"file": {"workers": math.inf}}, r"expected an integer"),
        ({"cli": {"workers": "1_0"}}, r"invalid --workers: '1_0' \(expected an integer\)"),
        ({"cli": {"workers": ARABIC_ONE}}, r"expected an integer"),
        ({"cli": {"workers": "257"}}, r"must be at most 256"),
        ({"file": {"workers": 2**63}}, r"must be at most 256"),
        ({"file": {"lease": math.inf}}, r"invalid --lease \(from config lease\): inf"),
        ({"file": {"lease": date(2020, 1, 1)}}, r"expected a duration"),
        ({"file": {"lease": [1]}}, r"expected a duration"),
        ({"cli": {"lease": "500ms"}}, r"invalid --lease: '500ms' \(must be at least 1s\)"),
        ({"cli": {"lease": "2d"}}, r"must be at most 1d"),
        ({"cli": {"publish_timeout": "5ms"}}, r"must be at least 10ms"),
        ({"cli": {"poll_interval": "0"}}, r"must be at least 10ms"),
        ({"cli": {"poll_interval": "2h"}}, r"must be at most 1h"),
        ({"cli": {"backoff_base": "0s"}}, r"must be at least 1ms"),
        ({"cli": {"backoff_cap": "2d"}}, r"must be at most 1d"),
        ({"cli": {"shutdown_grace": "2h"}}, r"must be at most 1h"),
        ({"cli": {"defer_max_age": "366d"}}, r"must be at most 365d"),
        ({"cli": {"prune_older_than": "30s"}}, r"must be at least 1m"),
        ({"cli": {"prune_interval": "0s"}}, r"must be at least 1s"),
        ({"cli": {"metrics_port": "65536"}}, r"must be at most 65535"),
        ({"cli": {"table": ""}}, r"invalid --table: must not be empty"),
        ({"env": {"RELAY_SCHEMA": ""}}, r"invalid --schema \(from RELAY_SCHEMA\): must not be empty"),
        ({"file": {"table": ""}}, r"invalid --table \(from config table\): must not be empty"),
        ({"file": {"table": "   "}}, r"must not be empty"),
    ],
)
def test_option_bounds_and_types(source: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _resolve(source.get("cli"), source.get("file"), source.get("env"))
    assert "\n" not in str(info.value)


def test_in_range_values_and_empty_variables() -> None:
    v = _resolve({"workers": " 10 ", "lease": "1s", "publish_timeout": "10ms"}, env={"RELAY_POLL_INTERVAL": ""})
    assert v["workers"] == 10 and v["lease"] == timedelta(seconds=1) and v["publish_timeout"] == timedelta(seconds=0.01)
    assert v["poll_interval"] == timedelta(seconds=1)  # an empty variable is still "not set" where empty is no value
    assert _resolve(file={"workers": 256, "lease": 86400})["lease"] == timedelta(days=1)


def test_prune_interval_zero_is_not_an_hour() -> None:
    assert Operations.from_values({"prune_interval": timedelta(0)}).prune_interval == timedelta(0)
    assert Operations.from_values({}).prune_interval == timedelta(hours=1)


def test_names_have_postgresql_limits() -> None:
    started = time.monotonic()
    long_name = r"invalid table name 'tttt.*\(1,000,000 characters\): longer than 40"
    with pytest.raises(ConfigError, match=long_name) as info:
        OutboxNames(table="t" * 1_000_000)
    assert time.monotonic() - started < 1 and len(str(info.value)) < 250
    with pytest.raises(ConfigError, match="wake-up channel"):
        OutboxNames(schema="s" * 23, table="t" * 40)  # 64 characters with the dot
    OutboxNames(schema="s" * 22, table="t" * 40)  # 63: the most pg_notify takes
    with pytest.raises(ConfigError, match="invalid table name"):
        OutboxNames(table="outbox\n")


def test_config_file_limits(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("ordered = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_file(str(deep))
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        load_file(str(big))
    just = tmp_path / "just.toml"
    just.write_bytes(b"workers = 3\n" + b" " * (MAX_CONFIG_BYTES - 12))
    assert load_file(str(just)) == {"workers": 3}


def test_ascii_int() -> None:
    kind = AsciiInt(1, 100)
    assert kind.convert("42", None, None) == 42 and kind.convert(7, None, None) == 7
    for bad in ("1_0", ARABIC_ONE, SUPERSCRIPT_TWO, "4.0", "", "0", "101", "9" * 50):
        with pytest.raises(Exception, match="not"):
            kind.convert(bad, None, None)
