"""The list of outboxes one process serves ([[outboxes]] and Relay(outboxes=...)): what
is refused, what each outbox reads, and which outboxes share a publisher. Nothing here
connects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay import ConfigError, Relay
from relay.compose import compose_outboxes
from relay.outboxes import MAX_OUTBOXES
from relay.testing import InMemoryPublisher
from tests.relay_process import assert_one_line_error, relay_env, run_relay

TOP = (
    'broker = "rabbitmq"\ndsn = "postgresql://relay@db/app"\nworkers = 2\n[rabbitmq]\nurl = "amqp://guest:guest@mq/"\n'
)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "relay.toml"
    path.write_text(text)
    return str(path)


def entry(name: str, extra: str = "") -> str:
    return f'\n[[outboxes]]\nname = "{name}"\nschema = "{name.replace("-", "_")}"\n{extra}'


def test_each_outbox_reads_the_files_defaults_under_its_own_values(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        TOP
        + entry("billing", "workers = 1\n[outboxes.ordering]\nordered = ['Invoice*']\n")
        + entry("shipping", "[outboxes.rabbitmq]\nexchange = 'shipping'\n")
        + entry("crm"),
    )
    fleet = compose_outboxes({}, config=config)
    assert fleet is not None
    by = {o.name: o.parts.settings for o in fleet.outboxes}
    assert [o.name for o in fleet.outboxes] == ["billing", "shipping", "crm"]
    assert {n: s.workers for n, s in by.items()} == {"billing": 1, "shipping": 2, "crm": 2}
    assert {n: s.names.qualified for n, s in by.items()} == {
        "billing": "billing.outbox",
        "shipping": "shipping.outbox",
        "crm": "crm.outbox",
    }
    assert all(s.dsn == "postgresql://relay@db/app" for s in by.values())
    assert "Invoice*" in by["billing"].ordering.describe() and "Invoice*" not in by["crm"].ordering.describe()
    # One publisher for the outboxes whose destination settings agree, another for shipping's exchange.
    publishers = {o.name: o.parts.publisher for o in fleet.outboxes}
    assert publishers["billing"] is publishers["crm"] is not publishers["shipping"]
    assert len(fleet.publishers) == 2


def test_a_flag_applies_to_every_outbox_over_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, TOP + entry("a", "workers = 1\n") + entry("b"))
    fleet = compose_outboxes({"workers": 3}, config=config)
    assert fleet is not None and {o.parts.settings.workers for o in fleet.outboxes} == {3}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        pytest.param(TOP + entry("a") + entry("a", "table = 'other'\n"), "two outboxes are named 'a'", id="twice"),
        pytest.param(TOP + entry("a") + '\n[[outboxes]]\nschema = "b"\n', "every outbox needs a name", id="no-name"),
        pytest.param(TOP + entry("Bad Name"), "invalid name 'Bad Name'", id="bad-name"),
        pytest.param(
            TOP + entry("a", "metrics_port = 9000\n"), "metrics_port is a setting of the process", id="process"
        ),
        pytest.param(TOP + entry("a", "workerz = 2\n"), "unknown key 'workerz'", id="typo"),
        pytest.param(TOP + entry("a", "workers = 0\n"), "outbox a: invalid --workers", id="bad-value"),
        pytest.param(
            TOP + entry("a") + '\n[[outboxes]]\nname = "b"\nschema = "a"\n', "outboxes a and b are the same", id="same"
        ),
        pytest.param("outboxes = []\n" + TOP, "the list of outboxes is empty", id="empty"),
    ],
)
def test_a_wrong_listing_is_refused_naming_the_outbox(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as raised:
        compose_outboxes({}, config=write(tmp_path, text))
    assert needle in str(raised.value), str(raised.value)


def test_too_many_outboxes_are_refused(tmp_path: Path) -> None:
    text = TOP + "".join(entry(f"o{i}") for i in range(MAX_OUTBOXES + 1))
    with pytest.raises(ConfigError, match=f"one process serves at most {MAX_OUTBOXES}"):
        compose_outboxes({}, config=write(tmp_path, text))


def test_where_an_outbox_is_cannot_come_from_a_flag_or_variable(tmp_path: Path) -> None:
    config = write(tmp_path, TOP + entry("a") + entry("b"))
    with pytest.raises(ConfigError, match="--schema names one outbox, but several are listed"):
        compose_outboxes({"schema": "x"}, config=config)
    with pytest.raises(ConfigError, match="RELAY_DSN names one outbox, but several are listed: unset it"):
        compose_outboxes({}, config=config, environ={"RELAY_DSN": "postgresql://x@y/z"})


def test_outbox_chooses_one_of_the_list_and_runs_it_alone(tmp_path: Path) -> None:
    config = write(tmp_path, TOP + entry("a") + entry("b", "workers = 1\n"))
    assert compose_outboxes({"outbox": "b"}, config=config) is None
    relay = Relay(config=config, outbox="b", publisher=InMemoryPublisher())
    assert relay.outboxes == () and relay.settings.names.qualified == "b.outbox" and relay.settings.workers == 1
    with pytest.raises(ConfigError, match="lists no outbox of that name"):
        Relay(config=config, outbox="c")


def test_relay_takes_the_list_in_python(tmp_path: Path) -> None:
    relay = Relay(
        dsn="postgresql://relay@db/app",
        publisher=InMemoryPublisher(),
        outboxes=[{"name": "a", "schema": "a"}, {"name": "b", "schema": "b", "workers": 1}],
    )
    assert relay.outboxes == ("a", "b")
    with pytest.raises(ConfigError, match="listed twice"):
        Relay(config=write(tmp_path, TOP + entry("a")), outboxes=[{"name": "b"}], publisher=InMemoryPublisher())
    with pytest.raises(ConfigError, match="unknown setting of outbox a 'wrkers'"):
        Relay(dsn="postgresql://x@y/z", publisher=InMemoryPublisher(), outboxes=[{"name": "a", "wrkers": 1}])


def test_commands_that_act_on_one_outbox_ask_which(tmp_path: Path) -> None:
    config = write(tmp_path, TOP + entry("a") + entry("b"))
    assert_one_line_error(
        run_relay("dead", "list", "--config", config, env=relay_env()),
        "lists 2 outboxes: choose the one `relay dead list` acts on with --outbox NAME (a, b)",
    )
    assert_one_line_error(
        run_relay("dead", "list", "--outbox", "a", env=relay_env()), "--outbox 'a' chooses among the outboxes"
    )
    assert_one_line_error(
        run_relay("start", "--config", config, "--dsn", "postgresql://x@y/z", env=relay_env()),
        "--dsn names one outbox, but several are listed",
    )


def test_the_documented_config_composes_as_the_page_says(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "outboxes.md").read_text()
    [text] = re.findall(r"```toml\n(.*?)```", page, re.S)
    fleet = compose_outboxes({}, config=write(tmp_path, text))
    assert fleet is not None
    by = {o.name: o.parts for o in fleet.outboxes}
    assert list(by) == ["billing", "shipping", "tenant-42"]
    assert {n: p.settings.workers for n, p in by.items()} == {"billing": 1, "shipping": 2, "tenant-42": 1}
    assert by["tenant-42"].settings.dsn == "postgresql://relay@tenant42.internal/app"
    assert by["billing"].settings.dsn == by["shipping"].settings.dsn == "postgresql://relay@db.internal/app"
    assert "Shipment*" in by["shipping"].settings.ordering.describe()
    # "2 database pools, 2 broker connections": tenant-42's exchange is its own.
    assert by["billing"].publisher is by["shipping"].publisher is not by["tenant-42"].publisher
    assert len(fleet.publishers) == 2 and fleet.operations.metrics_port == 9100
    assert "2 database pools, 2 broker connections" in page


def test_outboxes_that_write_different_cloudevents_do_not_share_a_publisher(tmp_path: Path) -> None:
    http = 'broker = "http"\ndsn = "postgresql://relay@db/app"\nenvelope = "cloudevents"\n[http]\nurl = "https://h.example/e"\n'
    fleet = compose_outboxes({}, config=write(tmp_path, http + entry("a") + entry("b")))
    assert fleet is not None
    a, b = (o.parts for o in fleet.outboxes)
    # Each event's source names its own outbox by default: one publisher each.
    assert a.settings.cloudevents != b.settings.cloudevents and a.publisher is not b.publisher
    shared = compose_outboxes(
        {"cloudevents_source": "urn:shop"}, config=write(tmp_path, http + entry("a") + entry("b"))
    )
    assert shared is not None and len(shared.publishers) == 1
