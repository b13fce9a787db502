"""The README's quick start, run as written: its shell block (migrate, then `relay start
--broker log`), its SQL and its Python, against a database of its own, and what the relay
prints compared with the output the README shows.

The blocks are found by the HTML comments in front of them (``<!-- quickstart-shell``
...), so an edit that changes a command is run by this test, and one that drops a block
fails it. Only the DSN in the shell block's ``export`` line is replaced, by the test's.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"<!-- quickstart-(?P<name>[a-z]+)[^>]*-->\n```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)
EXPORT = re.compile(r"^export RELAY_DSN=\S+$", re.M)


def quickstart_blocks() -> dict[str, tuple[str, str]]:
    """The quick start's blocks by name: (language, text)."""
    return {m["name"]: (m["lang"], m["body"]) for m in BLOCK.finditer(README.read_text())}


def test_the_readme_has_every_quickstart_block() -> None:
    blocks = quickstart_blocks()
    assert {name: lang for name, (lang, _) in blocks.items()} == {
        "shell": "sh",
        "sql": "sql",
        "python": "python",
        "output": "text",
    }
    assert len(EXPORT.findall(blocks["shell"][1])) == 1, "the shell block sets RELAY_DSN once"


def _url(dsn: str) -> str:
    """``dsn`` as the postgresql:// URL the README's export line writes (no spaces)."""
    parts = conninfo_to_dict(dsn)
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{parts.get('host', 'localhost')}{port}/{parts['dbname']}"


def _outbox_exists(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT to_regclass('public.outbox') IS NOT NULL").fetchone() == (True,)


def _read_events(proc: subprocess.Popen[str], count: int, timeout: float) -> list[dict[str, Any]]:
    """The first ``count`` JSON lines on stdout (``relay migrate`` prints its own lines first)."""
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True).start()
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while len(events) < count and time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            continue
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


def test_the_quickstart_runs_as_written(scratch_dsn: str) -> None:
    # A database of its own, as a reader's would be: empty, the public schema only.
    blocks = quickstart_blocks()
    url = _url(scratch_dsn)
    shell = EXPORT.sub(f"export RELAY_DSN={url}", blocks["shell"][1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    relay = subprocess.Popen(
        ["bash", "-e", "-c", shell],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _outbox_exists(scratch_dsn):
            assert relay.poll() is None, relay.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "relay migrate did not create public.outbox"
            time.sleep(0.1)
        # The second terminal: the SQL as psql would send it, then the Python as a script.
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(blocks["sql"][1].encode())
        python = subprocess.run(
            [sys.executable, "-c", blocks["python"][1]],
            env={**env, "RELAY_DSN": url},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert python.returncode == 0, python.stderr[-2000:]
        got = _read_events(relay, 2, timeout=30)
    finally:
        os.killpg(relay.pid, signal.SIGTERM)
        _, stderr = relay.communicate(timeout=30)
    assert relay.returncode == 0, stderr[-2000:]
    assert "relay started" in stderr

    shown = [json.loads(line) for line in blocks["output"][1].splitlines()]
    assert [list(e) for e in got] == [list(e) for e in shown], "the README shows other fields, or in another order"
    # What the README shows is what came: every field but those that differ by run.
    varying = {"event_id", "aggregate_epoch"}
    for printed, readme in zip(got, shown, strict=True):
        assert {k: v for k, v in printed.items() if k not in varying} == {
            k: v for k, v in readme.items() if k not in varying
        }
    # One epoch, the aggregate's first: <timeline>.<first seq>.<token>, starting at seq 1.
    assert got[0]["aggregate_epoch"] == got[1]["aggregate_epoch"]
    assert got[0]["aggregate_epoch"].split(".")[1] == shown[0]["aggregate_epoch"].split(".")[1] == "1"
    uuid.UUID(got[1]["event_id"])
