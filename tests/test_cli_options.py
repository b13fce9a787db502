"""Every option of every command goes through the one option system (relay.options): declared,
attached by relay.cli.common.with_options, and read flag over RELAY_* variable over the
config file over the default, the operator commands' as relay start's.

The first part needs no service; the last runs `relay dead list` and `relay console` as
processes against PostgreSQL.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import pytest

from relay import Relay
from relay.cli.common import ALL_OPTIONS, KNOWN_VARIABLES, DeclaredOption, settings_for, with_options
from relay.cli.console import CONSOLE_ALL
from relay.cli.dead import DEAD_LIST_ALL
from relay.cli.main import cli
from relay.cli.ops import PRUNE_ALL, STATUS_ALL
from relay.db.dispatch import OutboxStore
from relay.errors import ConfigError
from relay.operator_options import DEAD_GROUPS_PER_PAGE, JSON, OPERATOR_OPTIONS
from relay.ops.deadletters import GROUPS_PER_PAGE
from relay.options import Option, check_file_keys, resolve
from tests.conftest import Db
from tests.ops_helpers import claim_until, kill, target
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay

ROOT = Path(__file__).resolve().parent.parent
NO_DB = "postgresql://nobody@127.0.0.1:1/never"  # refused before any connection

# The click options that are not made from a declared Option, each with its reason: every
# command takes --config (the file the others are read from: it cannot sit in itself), and
# the group --version.
PLAIN_OPTIONS: dict[tuple[str, str], str] = {
    ("*", "config_path"): "--config names the file",
    ("relay", "version"): "click's --version",
}
# Where `click.option(` may be written: the engine's attachment (with_options, --config).
CLICK_OPTION_FILES = {"relay/cli/common.py"}


def commands(group: click.Command = cli, path: str = "relay") -> Iterator[tuple[str, click.Command]]:
    yield path, group
    if isinstance(group, click.Group):
        for name, sub in group.commands.items():
            yield from commands(sub, f"{path} {name}")


# ---- no plain click option remains


def test_every_option_of_every_command_is_declared() -> None:
    plain = []
    for path, command in commands():
        for p in command.params:
            if not isinstance(p, click.Option) or isinstance(p, DeclaredOption):
                continue
            if ("*", p.name) not in PLAIN_OPTIONS and (path, p.name) not in PLAIN_OPTIONS:
                plain.append(f"{path} {'/'.join(p.opts)}")
    assert not plain, f"plain click options, declare them in relay.operator_options: {plain}"
    # The allow-list holds nothing that is gone: each entry is still a plain option.
    present = {(path, p.name) for path, c in commands() for p in c.params if not isinstance(p, DeclaredOption)}
    stale = [k for k in PLAIN_OPTIONS if k[0] != "*" and k not in present]
    assert not stale, f"no longer plain, drop them from PLAIN_OPTIONS: {stale}"


def test_click_option_is_written_only_where_the_engine_attaches_options() -> None:
    found = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "relay").rglob("*.py")
        if re.search(r"\bclick\.option\(", path.read_text(encoding="utf-8"))
    }
    assert found <= CLICK_OPTION_FILES, found - CLICK_OPTION_FILES


def test_each_command_option_is_its_declaration() -> None:
    declared = {o.dest for o in ALL_OPTIONS}
    for path, command in commands():
        for p in command.params:
            if not isinstance(p, DeclaredOption):
                continue
            o = p.declared
            assert o.dest in declared, (path, o.dest)  # the file's key check knows it
            assert p.name == o.param, (path, p.name, o.param)
            assert p.opts == [o.flag], (path, p.opts)
            pair = o.kind == "bool" and not (o.cli_only and o.default is False)
            assert p.secondary_opts == ([f"--no-{o.flag[2:]}"] if pair else []), (path, p.secondary_opts)
            if o.reads_env:
                assert f"[env {o.env}]" in (p.help or ""), (path, p.help)
            else:
                assert "[env " not in (p.help or ""), (path, p.help)


def test_the_console_and_dead_list_take_their_flags_as_before() -> None:
    # What scripts and deployments pass, and the names they have always arrived under.
    params = (
        cli.commands["console"]
        .make_context(
            "console",
            ["--host", "0.0.0.0", "--port", "8000", "--allow-host", "a", "--allow-host", "b", "--allow-actions"],
        )
        .params
    )
    assert (params["host"], params["port"], params["allow_hosts"], params["allow_actions"]) == (
        "0.0.0.0",
        8000,
        ("a", "b"),
        True,
    )
    dead = cli.commands["dead"]
    assert isinstance(dead, click.Group)
    params = dead.commands["list"].make_context("list", ["--limit", "7", "--group", "--page", "2", "--json"]).params
    assert (params["limit"], params["group"], params["page"], params["json"]) == (7, True, 2, True)


def test_the_page_size_in_the_help_is_the_real_one() -> None:
    assert DEAD_GROUPS_PER_PAGE == GROUPS_PER_PAGE


# ---- the engine's extensions


def test_a_command_line_only_option_reads_no_variable_and_no_key() -> None:
    only = Option("x_count", "int", 1, "A count.", minimum=1, maximum=9, flag_name="--count", cli_only=True)
    assert only.flag == "--count" and only.param == "count" and not only.reads_env
    assert resolve([only], {}, {"x_count": 5}, {"RELAY_X_COUNT": "5"}) == {"x_count": 1}
    assert resolve([only], {"x_count": "3"}, {}, {"RELAY_X_COUNT": "5"}) == {"x_count": 3}
    with pytest.raises(ConfigError, match=r"unknown key 'x_count'"):
        check_file_keys({"x_count": 5}, [only], "relay.toml")
    assert JSON.env not in KNOWN_VARIABLES  # so RELAY_JSON=1 is warned about, not read


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cli_only": True, "env_only": True}, "exclude each other"),
        ({"cli_only": True, "section": "x"}, "has no key in the file"),
        ({"flag_name": "-p"}, "is not --lowercase-words"),
        ({"flag_name": "--Port"}, "is not --lowercase-words"),
    ],
)
def test_mistaken_declarations_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Option("x", "str", None, "X.", **fields)


def test_two_options_with_one_flag_are_refused() -> None:
    a = Option("a_limit", "int", 1, "A.", minimum=1, maximum=2, flag_name="--limit")
    b = Option("b_limit", "int", 1, "B.", minimum=1, maximum=2, flag_name="--limit")
    with pytest.raises(ValueError, match="take the flag of limit"):
        with_options((a, b))


def test_the_help_shows_default_bounds_and_variable() -> None:
    console = cli.commands["console"]
    port = next(p for p in console.params if p.name == "port")
    assert port.help == "Port (0: any free port). [default: 8465] [0..65535] [env RELAY_CONSOLE_PORT]"
    token = next(p for p in console.params if p.name == "token")
    assert token.help is not None and "[env" not in token.help and "default" not in token.help


# ---- the variable and the file reach the operator commands (resolved as the commands do)


def test_a_variable_and_a_key_reach_console_port_and_dead_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in relay_env() if n.startswith("RELAY_")] + ["RELAY_CONSOLE_PORT", "RELAY_DEAD_LIMIT"]:
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "relay.toml"
    config.write_text('[console]\nport = 9001\nhistory = "2h"\n[dead]\nlimit = 3\n[prune]\nchunk_size = 10\n')

    def console(*args: str) -> dict[str, Any]:
        params = cli.commands["console"].make_context("console", list(args)).params
        return settings_for(CONSOLE_ALL, dict(params))

    def dead_list(*args: str) -> dict[str, Any]:
        dead = cli.commands["dead"]
        assert isinstance(dead, click.Group)
        return settings_for(DEAD_LIST_ALL, dict(dead.commands["list"].make_context("list", list(args)).params))

    assert console()["console_port"] == 8465 and dead_list()["dead_limit"] == 100  # the defaults
    assert console("--config", str(config))["console_port"] == 9001  # the file
    assert console("--config", str(config))["console_history"] == timedelta(hours=2)
    assert dead_list("--config", str(config))["dead_limit"] == 3
    monkeypatch.setenv("RELAY_CONSOLE_PORT", "9002")
    monkeypatch.setenv("RELAY_DEAD_LIMIT", "4")
    assert console("--config", str(config))["console_port"] == 9002  # the variable over the file
    assert dead_list("--config", str(config))["dead_limit"] == 4
    assert console("--config", str(config), "--port", "9003")["console_port"] == 9003  # the flag over both
    assert dead_list("--config", str(config), "--limit", "5")["dead_limit"] == 5
    cmd = cli.commands["prune"]
    values = settings_for(PRUNE_ALL, dict(cmd.make_context("prune", ["--config", str(config)]).params))
    assert values["prune_chunk_size"] == 10
    monkeypatch.setenv("RELAY_STATUS_INTERVAL", "5s")
    values = settings_for(STATUS_ALL, dict(cli.commands["status"].make_context("status", []).params))
    assert values["status_interval"] == timedelta(seconds=5)


def test_the_file_may_hold_the_commands_tables_but_no_command_line_only_key(tmp_path: Path) -> None:
    file = {"console": {"port": 1, "allow_hosts": ["a"], "token": "t"}, "dead": {"limit": 2}, "status": {}}
    check_file_keys(file, ALL_OPTIONS, "relay.toml")
    for bad, message in (
        ({"console": {"prot": 1}}, "unknown key 'prot' in [console]"),
        ({"dead": {"page": 2}}, "unknown key 'page' in [dead]"),  # command line only
        ({"json": True}, "unknown key 'json'"),
        ({"console_port": 1}, "unknown key 'console_port'"),  # in its table, not at the top
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_file_keys(bad, ALL_OPTIONS, "relay.toml")


def test_every_operator_option_with_a_variable_has_a_table() -> None:
    # A command's setting sits in the command's table, named after it in its variable.
    for o in OPERATOR_OPTIONS:
        if o.reads_env:
            assert o.section is not None and o.env.startswith(f"RELAY_{o.section.upper()}_"), o.dest


def test_relay_start_accepts_the_operator_commands_tables(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text("[console]\nport = 9001\n[dead]\nlimit = 3\n")
    Relay(config=str(config), dsn=NO_DB, broker="log")


# ---- as processes: bad values from a variable or the file, one line


@pytest.mark.parametrize(
    ("args", "env", "file", "needle"),
    [
        (["console"], {"RELAY_CONSOLE_PORT": "70000"}, None, "invalid --port (from RELAY_CONSOLE_PORT): '70000'"),
        (["console"], {}, "[console]\nhistory = '5s'\n", "invalid --history (from config [console] history)"),
        (["dead", "list"], {"RELAY_DEAD_LIMIT": "0"}, None, "invalid --limit (from RELAY_DEAD_LIMIT): '0'"),
        (["dead", "list"], {}, "[dead]\nlimit = 1.5\n", "invalid --limit (from config [dead] limit): 1.5"),
        (["status"], {"RELAY_STATUS_INTERVAL": "10ms"}, None, "(must be at least 100ms)"),
        (["prune", "--older-than", "1d"], {"RELAY_PRUNE_CHUNK_SIZE": "1_0"}, None, "expected an integer"),
        (["console"], {}, "[console]\ntoken = 'x=short'\n", "invalid [console] token in the config file: the secret"),
        (["console"], {}, "[console]\nprot = 1\n", "unknown key 'prot' in [console]"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_bad_value_from_a_variable_or_the_file_is_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], file: str | None, needle: str
) -> None:
    extra = []
    if file is not None:
        (tmp_path / "relay.toml").write_text(file)
        extra = ["--config", str(tmp_path / "relay.toml")]
    proc = run_relay(*args, "--dsn", NO_DB, *extra, env=relay_env(**env), timeout=30)
    assert_one_line_error(proc, needle)
    assert "short" not in proc.stderr  # a token's secret is never shown


def test_a_token_from_the_file_lets_actions_on(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text("[console]\ntoken = 'alice=0123456789abcdef0123'\nallow_actions = true\n")
    proc = run_relay("console", "--config", str(config), "--dsn", NO_DB, "--port", "0", timeout=30)
    # Past the token check ("--allow-actions needs a token"), to the database, which is not there.
    assert_one_line_error(proc, "cannot connect to PostgreSQL")
    assert "0123456789abcdef0123" not in proc.stderr


def test_a_command_line_only_variable_is_not_read_and_is_warned_about(relay_dsn: str, db: Db) -> None:
    proc = run_relay("dead", "list", *target(relay_dsn, db), env=relay_env(RELAY_JSON="1"))
    assert proc.returncode == 0, proc.stderr
    assert not proc.stdout.startswith("{")  # the table, not JSON
    assert "RELAY_JSON is set, but no setting of the relay has that name" in proc.stderr


# ---- as processes: relay dead list --limit and relay console --port from a variable and the file


async def test_dead_list_limit_from_the_variable_and_the_file(
    store: OutboxStore, db: Db, relay_dsn: str, tmp_path: Path
) -> None:
    ids = db.insert([(f"a{i}", "OrderPlaced", {}) for i in range(4)])
    claimed = await claim_until(store, set(ids))
    await kill(store, [claimed[i] for i in ids], "PermanentError: refused")
    config = tmp_path / "relay.toml"
    config.write_text("[dead]\nlimit = 1\n")
    t = ["dead", "list", *target(relay_dsn, db), "--json"]
    runs = [
        (t, {}),  # the default: every one of the four
        ([*t, "--config", str(config)], {}),  # the file: 1
        ([*t, "--config", str(config)], {"RELAY_DEAD_LIMIT": "2"}),  # the variable over the file: 2
        ([*t, "--config", str(config), "--limit", "3"], {"RELAY_DEAD_LIMIT": "2"}),  # the flag over both: 3
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = list(pool.map(lambda run: run_relay(*run[0], env=relay_env(**run[1])), runs))
    shown = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr
        page = json.loads(proc.stdout)
        assert page["total"] == 4
        shown.append([m["id"] for m in page["messages"]])
    assert shown == [ids, ids[:1], ids[:2], ids[:3]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_console_port_from_the_variable_and_the_file(relay_dsn: str, db: Db, tmp_path: Path) -> None:
    in_file, in_env = free_port(), free_port()
    config = tmp_path / "relay.toml"
    config.write_text(f"[console]\nport = {in_file}\n")
    base = ["console", *target(relay_dsn, db), "--config", str(config)]
    for env, port in (({}, in_file), ({"RELAY_CONSOLE_PORT": str(in_env)}, in_env)):
        with RelayProcess(*base, env=relay_env(**env)) as proc:
            await proc.wait_for_log(f"console at http://127.0.0.1:{port}/", timeout=30)
            assert proc.stop(timeout=15) == 0


def test_the_reference_lists_the_variable_and_key_of_each_command_option() -> None:
    # The committed page (test_docs_reference keeps it current): each command's table has
    # each of its options with the variable and key they are read from.
    page = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    console = page[page.index("### relay console {#relay-console}") : page.index("## Settings {#settings}")]
    row = next(line for line in console.splitlines() if line.startswith("| [`--port`]"))
    assert "`RELAY_CONSOLE_PORT`" in row and "`[console] port`" in row and "`0..65535`" in row
    dead = page[page.index("#### relay dead list {#relay-dead-list}") : page.index("#### relay dead retry")]
    row = next(line for line in dead.splitlines() if line.startswith("| [`--limit`]"))
    assert "`RELAY_DEAD_LIMIT`" in row and "`[dead] limit`" in row
    row = next(line for line in dead.splitlines() if line.startswith("| [`--json`]"))
    assert "(command line only)" in row


def test_a_changed_declaration_changes_the_command_tables() -> None:
    from scripts import docs_reference as ref

    groups = ref.settings_groups()
    before = ref.render_cli(cli, groups)
    target_option = next(o for g in groups for o in g.options if o.dest == "console_port")
    changed = replace(target_option, maximum=9999)
    groups = tuple(replace(g, options=tuple(changed if o is target_option else o for o in g.options)) for g in groups)
    after = ref.render_cli(cli, groups)
    assert after != before
    console = after[after.index("### relay console {#relay-console}") :]
    assert "`0..9999`" in next(line for line in console.splitlines() if line.startswith("| [`--port`]"))
