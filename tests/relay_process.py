"""The real `relay` console script as a subprocess, the one harness every test uses for it.

- :func:`relay_env`: the environment a relay under test runs with.
- :func:`run_relay`: a command that finishes (``relay migrate``, ``relay status``, a
  ``relay start`` that must refuse to start), its output captured.
- :class:`RelayProcess`: a command that runs until stopped (``relay start``), its stdout
  and stderr written to files, never to a pipe: a pipe nobody reads fills up and blocks a
  chatty relay mid-test. It records what the test did to it on purpose (a crash by
  SIGKILL, a hang by SIGSTOP) and whether :meth:`RelayProcess.stop` had to fall back to
  SIGKILL, so :meth:`RelayProcess.assert_clean_exit` tells a clean shutdown from a relay
  that hung on SIGTERM.
- :func:`wait_until` (and :func:`wait_until_async`, for a test whose event loop must keep
  running meanwhile): poll a condition until it holds or time runs out.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

RELAY = str(Path(sys.executable).with_name("relay"))

# Credentials that reach no AWS account: neither a relay under test nor a boto3 client in
# the tests may ever use real ones (moto accepts anything).
FAKE_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
# How long stop() waits for a relay to drain and exit after SIGTERM before it kills it.
TERM_TIMEOUT_S = 30.0


def relay_env(**extra: str) -> dict[str, str]:
    """This environment without any RELAY_* setting but the tests' own RELAY_TEST_* (each
    test passes the settings it means, in ``extra`` or as flags), with fake AWS credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_") or k.startswith("RELAY_TEST_")}
    env.update(FAKE_AWS_ENV)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        env.pop(key, None)
    env.update(extra)
    return env


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *needles: str, code: int = 2) -> str:
    """Exit ``code``, exactly one ``relay: ...`` line on stderr (short enough to read), no
    traceback, each needle in it; returns the line."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("relay: "), lines[0]
    assert len(lines[0]) < 400, lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run_relay(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RELAY, *args], capture_output=True, text=True, timeout=timeout, env=env or relay_env())


class RelayProcess:
    """``relay ARGS`` (for instance ``RelayProcess("start", "--broker", "log")``) running in
    the background until the test stops it.

    ``discard_stdout`` sends stdout to /dev/null instead (the log broker's messages, when
    they are many megabytes and no test reads them). ``program`` replaces the relay
    script, for tests of this harness with a stand-in.
    """

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        term_timeout_s: float = TERM_TIMEOUT_S,
        discard_stdout: bool = False,
        program: Sequence[str] = (RELAY,),
    ) -> None:
        self.term_timeout_s = term_timeout_s
        self.crashed = False  # the test SIGKILLed it on purpose
        self.frozen = False  # the test SIGSTOPped it on purpose (a hang), and never let it go on
        self.fallback_killed = False  # it did not exit in time after SIGTERM, and stop() killed it
        files = Path(tempfile.mkdtemp(prefix="relay-process-"))
        # Removed by close(), or once the object is gone (a Fleet's relays are read after
        # they stopped, for the clean-exit check, and are not always closed explicitly).
        self._remove_files = weakref.finalize(self, shutil.rmtree, files, ignore_errors=True)
        self.stdout_path = files / "stdout"
        self.stderr_path = files / "stderr"
        # Opened for appending and read back by path: the relay's writes never land where a
        # read by the test has moved a shared file offset.
        with self.stdout_path.open("ab") as out, self.stderr_path.open("ab") as err:
            self.proc = subprocess.Popen(
                [*program, *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if discard_stdout else out,
                stderr=err,
                env=env or relay_env(),
            )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def running(self) -> bool:
        return self.proc.poll() is None

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        """The relay's log so far."""
        return self.stderr_path.read_text()

    def tail(self, lines: int = 25) -> str:
        """The last ``lines`` of the log, for a failure message."""
        text = self.stderr_path.read_text(errors="replace")
        return "".join(text.splitlines(keepends=True)[-lines:])

    def kill(self) -> None:
        """Crash it on purpose: SIGKILL, no drain, no finalize."""
        if self.running():
            self.crashed = True
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def freeze(self) -> None:
        """Hang it on purpose: SIGSTOP (:meth:`thaw` lets it go on). stop() on a frozen relay
        ends in the fallback kill, which :meth:`assert_clean_exit` then accepts."""
        self.proc.send_signal(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.frozen = False

    def terminate(self) -> None:
        """SIGTERM, as a deployment stops a relay, without waiting (see :meth:`stop`)."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has exited (after :meth:`terminate`); SIGKILL after
        ``timeout`` (``term_timeout_s`` unless given), recorded as the fallback kill."""
        try:
            return self.proc.wait(timeout=self.term_timeout_s if timeout is None else timeout)
        except subprocess.TimeoutExpired:
            self.fallback_killed = True
            self.proc.kill()
            return self.proc.wait()

    def stop(self, timeout: float | None = None) -> int:
        """SIGTERM, then its exit code: 0 for a clean drain; ``-SIGKILL`` when it did not exit
        within ``timeout`` and had to be killed (``fallback_killed`` says so)."""
        self.terminate()
        return self.wait(timeout)

    def close(self) -> None:
        """Cleanup after the test: kill it if it still runs, remove its output files."""
        if self.running():
            self.proc.kill()
        self.proc.wait()
        self._remove_files()

    def __enter__(self) -> RelayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def assert_clean_exit(self) -> None:
        """It exited 0 (stopped with SIGTERM, or on its own), or the test killed it on purpose
        and it died of that SIGKILL; else fail with its log's tail. A relay that ignored
        SIGTERM and was killed by stop() fails."""
        code = self.returncode
        if code is None:
            how = "is still running"
        elif self.crashed or self.frozen:
            if code == -signal.SIGKILL:
                return
            how = f"was killed on purpose but exited with {code}"
        elif self.fallback_killed:
            how = "did not exit on SIGTERM and was killed"
        elif code != 0:
            how = f"exited with {code}"
        else:
            return
        raise AssertionError(f"relay pid {self.pid} {how}:\n{self.tail()}")

    async def wait_for_log(self, text: str, timeout: float = 20) -> None:
        """Until ``text`` is in its log; fails if it exits first or ``timeout`` passes."""
        started = time.monotonic()
        while text not in self.stderr():
            assert self.running(), self.stderr()
            assert time.monotonic() - started < timeout, f"no {text!r} in: {self.stderr()}"
            await asyncio.sleep(0.05)


def assert_clean_exits(processes: Iterable[RelayProcess]) -> None:
    """:meth:`RelayProcess.assert_clean_exit` for each of ``processes``."""
    for process in processes:
        process.assert_clean_exit()


def wait_until(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.1) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout`` seconds pass (its last answer)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


def kill_relays_while(
    busy: Callable[[], bool],
    relays: list[RelayProcess],
    start: Callable[[], object],
    rng: random.Random,
    *,
    at_least: int = 3,
) -> int:
    """SIGKILL one running relay of ``relays`` every 1-2 s (``rng`` picks when and which) and
    ``start`` another in its place, while ``busy()`` holds and at least ``at_least`` times;
    how many were killed."""
    kills = 0
    while busy() or kills < at_least:
        time.sleep(rng.uniform(1, 2))
        rng.choice([r for r in relays if r.running()]).kill()
        kills += 1
        start()
    return kills


async def wait_until_async(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    """:func:`wait_until` that sleeps on the event loop, for a test whose loop runs the relay
    (or a proxy) meanwhile; it polls more often, since in-process runs finish in milliseconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(interval)
    return check()


def popen_with_ctrl_c(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen`` with SIGINT at its default in the child, as in a terminal: a test
    run started in the background of a shell inherits SIGINT ignored, and so would the
    child (which would then keep running on Ctrl-C, as nohup'd programs rightly do)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # handled here: default after exec
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, previous)
