"""relay.Relay's and relay.Replay's keyword arguments are typed from the options they take
(relay/options_typed.py, generated): the file is current, and a type checker refuses a
misspelt or mistyped setting where the code is written, not when it runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MYPY = str(Path(sys.executable).with_name("mypy"))


def test_the_typed_options_are_generated_from_the_options_as_they_are() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/typed_options.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_type_checker_refuses_a_misspelt_or_mistyped_setting(tmp_path: Path) -> None:
    snippet = tmp_path / "uses_relay.py"
    snippet.write_text(
        "from datetime import timedelta\n"
        "from relay import Relay\n"
        'Relay(dsn="postgresql://x", broker="log", workers=2, lease=timedelta(seconds=30), ordered=["Order*"])\n'
        'Relay(dsn="postgresql://x", worker=2)\n'
        'Relay(dsn="postgresql://x", workers="2")\n'
        'Relay(dsn="postgresql://x", log_format="yaml")\n'
    )
    done = subprocess.run(
        [MYPY, "--no-error-summary", "--cache-dir", str(tmp_path / ".mypy_cache"), str(snippet)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["4", "5", "6"], done.stdout
    assert 'Unexpected keyword argument "worker"' in errors[0] and 'did you mean "workers"' in errors[0]
    assert 'incompatible type "str"; expected "int"' in errors[1]
    assert "Literal['text', 'json']" in errors[2]
