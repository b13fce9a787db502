"""Running the real `relay` console script as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RELAY = str(Path(sys.executable).with_name("relay"))


def relay_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_") or k.startswith("RELAY_TEST_")}
    env.update(extra)
    return env


def run_relay(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RELAY, *args], capture_output=True, text=True, timeout=timeout, env=env or relay_env())


def start_relay(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [RELAY, "start", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or relay_env(),
    )
