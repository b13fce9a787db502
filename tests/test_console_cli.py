"""`relay console` as a real process: it serves, says where, warns when bound beyond this
host, stops on SIGTERM with exit 0, and refuses bad input with one line (exit 2)."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest

from relay.db.names import OutboxNames
from tests.console_seed import SECRET, TOKEN
from tests.relay_process import RelayProcess, assert_one_line_error, relay_env, run_relay


def fetch(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status, r.read().decode()


async def console_url(proc: RelayProcess) -> str:
    await proc.wait_for_log("console at http://", timeout=30)
    m = re.search(r"console at (http://[^/\s]+/)", proc.stderr() + proc.stdout())
    assert m, proc.tail()
    return m.group(1)


async def test_it_serves_until_sigterm_and_never_logs_its_token(relay_dsn: str, names: OutboxNames) -> None:
    env = relay_env(RELAY_CONSOLE_TOKEN=TOKEN)
    args = ["console", "--dsn", relay_dsn, "--schema", names.schema, "--port", "0", "--allow-actions"]
    with RelayProcess(*args, env=env) as proc:
        url = await console_url(proc)
        assert url.startswith("http://127.0.0.1:")
        assert fetch(url + "healthz") == (200, "ok\n")
        status, page = fetch(url)
        assert status == 200 and "actions on" in page and names.qualified in page
        assert proc.stop(timeout=15) == 0
        output = proc.stdout() + proc.stderr()
    assert SECRET not in output
    assert "beyond this host" not in output


async def test_bound_beyond_loopback_it_warns_about_tls(relay_dsn: str, names: OutboxNames) -> None:
    args = ["console", "--dsn", relay_dsn, "--schema", names.schema, "--port", "0", "--host", "0.0.0.0"]
    with RelayProcess(*args) as proc:
        await proc.wait_for_log("beyond this host: put it behind a proxy that terminates TLS", timeout=30)
        await proc.wait_for_log("answers to any Host name on a wildcard address", timeout=5)
        assert proc.stop(timeout=15) == 0


@pytest.mark.parametrize(
    ("extra", "env", "needle"),
    [
        (["--allow-actions"], {}, "--allow-actions needs a token"),
        (["--token", "short"], {}, "invalid --token: the secret must be at least 16 printable characters"),
        (["--token", "bad name=0123456789abcdef"], {}, "invalid --token: the name before '='"),
        ([], {"RELAY_CONSOLE_TOKEN": "x"}, "invalid $RELAY_CONSOLE_TOKEN: the secret must be at least 16"),
        (["--history", "5s"], {}, "invalid --history"),
        (["--sample-interval", "1h"], {}, "invalid --sample-interval"),
        (["--port", "70000"], {}, "70000 is not in the range 0..65,535"),
        (["--by", ""], {}, "invalid --by: empty"),
        (["--allow-host", "relay.example:8465"], {}, "invalid --allow-host 'relay.example:8465': a host name"),
        (["--allow-host", " "], {}, "invalid --allow-host ' '"),
    ],
)
def test_bad_input_is_one_line(
    relay_dsn: str, names: OutboxNames, extra: list[str], env: dict[str, str], needle: str
) -> None:
    proc = run_relay("console", "--dsn", relay_dsn, "--schema", names.schema, *extra, env=relay_env(**env))
    assert_one_line_error(proc, needle)
    assert SECRET not in proc.stderr


def test_an_unreachable_database_is_one_line_without_the_password() -> None:
    proc = run_relay("console", "--dsn", "postgresql://u:Sup3rSecret@127.0.0.1:1/db", "--port", "0")
    assert_one_line_error(proc, "cannot connect to PostgreSQL at")
    assert "Sup3rSecret" not in proc.stderr


def test_a_port_in_use_is_one_line(relay_dsn: str, names: OutboxNames) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_relay("console", "--dsn", relay_dsn, "--schema", names.schema, "--port", str(port))
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}")
