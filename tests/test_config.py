"""Settings: precedence, parsing, and one-line errors for every kind of bad input."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from relay.config import CORE_OPTIONS, START_OPTIONS, RelaySettings
from relay.db.names import OutboxNames
from relay.durations import format_duration, parse_duration
from relay.errors import ConfigError
from relay.options import Given, check_file_keys, load_file, resolve, source_of

OPTIONS = (*CORE_OPTIONS, *START_OPTIONS)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30),
        ("5m", 300),
        ("2h", 7200),
        ("7d", 604800),
        ("1m30s", 90),
        ("1.5", 1.5),
        (" 10 s ", 10),
        (0, 0),
        (12, 12),
    ],
)
def test_durations(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["", "abc", "10 parsecs", "5mm", "-3s", "s", "1h-", True])
def test_bad_durations_name_the_setting(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^invalid --lease"):
        parse_duration(bad, name="--lease")  # type: ignore[arg-type]


def test_format_duration() -> None:
    assert [format_duration(timedelta(seconds=s)) for s in (0.2, 30, 150, 7200, 259200)] == [
        "200ms",
        "30s",
        "2.5m",
        "2h",
        "3d",
    ]


def test_precedence_cli_over_env_over_file_over_default() -> None:
    file = {"workers": 3, "batch_size": 50, "lease": "45s", "ordering": {"ordered": ["Order*"]}}
    env = {"RELAY_WORKERS": "5", "RELAY_BATCH_SIZE": "70"}
    v = resolve(OPTIONS, {"workers": "9"}, file, env)
    assert v["workers"] == 9  # command line
    assert v["batch_size"] == 70  # environment
    assert v["lease"] == timedelta(seconds=45)  # file
    assert v["max_attempts"] == 12  # default
    assert v["ordered"] == ("Order*",)
    assert v["unordered"] == ()


def test_env_lists_are_comma_separated() -> None:
    v = resolve(OPTIONS, {}, {}, {"RELAY_ORDERED": "Order*, Payment*", "RELAY_ORDERING_DEFAULT": "unordered"})
    assert v["ordered"] == ("Order*", "Payment*")
    assert v["ordering_default"] == "unordered"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"cli": {"workers": "0"}}, r"invalid --workers: '0' \(must be at least 1\)"),
        ({"env": {"RELAY_BATCH_SIZE": "many"}}, r"invalid --batch-size \(from RELAY_BATCH_SIZE\): 'many'"),
        ({"file": {"lease": "forever"}}, r"invalid --lease \(from config lease\)"),
        ({"file": {"ordering": {"default": "sometimes"}}}, r"choose from ordered, unordered"),
        (
            {"cli": {"broker": "kafak"}},
            r"invalid --broker: 'kafak' \(choose from sqs, sns, rabbitmq, http, kafka, nats, log\)",
        ),
        ({"file": {"max_attempts": True}}, r"expected an integer"),
    ],
)
def test_bad_values_get_one_line_naming_where_they_came_from(source: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        resolve(OPTIONS, source.get("cli", {}), source.get("file", {}), source.get("env", {}))
    assert "\n" not in str(info.value)


def test_unknown_keys_in_the_file_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown key 'wokers'"):
        check_file_keys({"wokers": 3}, OPTIONS, "relay.toml")
    with pytest.raises(ConfigError, match=r"unknown key 'orderd' in \[ordering\]"):
        check_file_keys({"ordering": {"orderd": []}}, OPTIONS, "relay.toml")
    with pytest.raises(ConfigError, match=r"\[ordering\] must be a table"):
        check_file_keys({"ordering": 3}, OPTIONS, "relay.toml")
    check_file_keys({"workers": 3, "ordering": {"default": "ordered"}}, OPTIONS, "relay.toml")


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_file(str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("workers = [unclosed\n")
    with pytest.raises(ConfigError, match="malformed config file"):
        load_file(str(bad))
    with pytest.raises(ConfigError, match="is a directory"):
        load_file(str(tmp_path))


def _values(**over: object) -> dict:
    v = resolve(OPTIONS, {}, {}, {})
    v.update({"dsn": "postgresql://localhost/x", "broker": "log"})
    v.update(over)
    return v


def test_settings_validate_together() -> None:
    s = RelaySettings.from_values(_values())
    assert s.workers == 4 and s.worker.batch_size == 100 and s.worker.lease == timedelta(seconds=60)
    assert s.ordering.default_ordered
    with pytest.raises(ConfigError, match="no database given"):
        RelaySettings.from_values(_values(dsn=None))
    with pytest.raises(ConfigError, match="no broker chosen"):
        RelaySettings.from_values(_values(broker=None))
    with pytest.raises(ConfigError, match=r"--publish-timeout \(60s\) must end inside --lease \(30s\)"):
        RelaySettings.from_values(_values(lease=timedelta(seconds=30), publish_timeout=timedelta(seconds=60)))
    with pytest.raises(ConfigError, match="backoff-cap"):
        RelaySettings.from_values(_values(backoff_cap=timedelta(seconds=1), backoff_base=timedelta(seconds=2)))
    with pytest.raises(ConfigError, match="both ordered and unordered"):
        RelaySettings.from_values(_values(ordered=("A",), unordered=("A",)))


@pytest.mark.parametrize("bad", ["Outbox", "1outbox", "out-box", "outbox; drop table x", "a" * 41, ""])
def test_table_and_schema_names_are_validated(bad: str) -> None:
    with pytest.raises(ConfigError, match="invalid table name"):
        OutboxNames(table=bad)
    with pytest.raises(ConfigError, match="invalid schema name"):
        OutboxNames(schema=bad)


def test_names_reach_sql_only_as_quoted_identifiers() -> None:
    names = OutboxNames(schema="sales", table="events_outbox")
    rendered = names.render("SELECT 1 FROM {outbox} JOIN {q_migrations} ON true -- {n_pending_idx}")
    assert rendered.as_string() == (
        'SELECT 1 FROM "sales"."events_outbox" JOIN "sales"."events_outbox_migrations" ON true'
        ' -- "events_outbox_pending_idx"'
    )
    with pytest.raises(KeyError):
        names.render("SELECT {evil}")


def test_source_of_is_the_precedence_resolve_and_the_shared_settings_check_use() -> None:
    workers = next(o for o in START_OPTIONS if o.dest == "workers")
    ordered = next(o for o in START_OPTIONS if o.dest == "ordered")
    file = {"workers": 3, "ordering": {"ordered": ["Order*"]}}
    env = {"RELAY_WORKERS": "5"}
    assert source_of(workers, {"workers": "7"}, file, env) == Given("command line", "7")
    assert source_of(workers, {}, file, env) == Given("RELAY_WORKERS", "5")
    assert source_of(workers, {}, file, {"RELAY_WORKERS": ""}) == Given("config workers", 3)  # empty: not set
    assert source_of(ordered, {"ordered": ()}, file, {}) == Given("config [ordering] ordered", ["Order*"])
    assert source_of(workers, {}, {}, {}) is None  # the default applies


def test_the_grant_settings_are_read_from_the_config_file(tmp_path: Path) -> None:
    # `relay migrate --config` and `relay grants --config` refused grant_producer as an
    # unknown key, although both commands declare it and read its variable.
    from relay.cli.common import settings_for
    from relay.cli.grants import GRANTS_OPTIONS

    config = tmp_path / "relay.toml"
    config.write_text(
        'dsn = "postgresql://app@db/app"\ngrant_producer = ["orders_app"]\ngrant_relay = ["outbox_relay"]\n'
    )
    values = settings_for(GRANTS_OPTIONS, {"config_path": str(config)})
    assert values["grant_producer"] == ("orders_app",) and values["grant_relay"] == ("outbox_relay",)
