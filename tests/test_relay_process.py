"""The relay-process harness itself (tests/relay_process.py), with stand-ins for a relay:
its exit-code checks must be able to fail, and its output must never block a process."""

from __future__ import annotations

import signal
import sys

import pytest

from tests.relay_process import RelayProcess, assert_clean_exits, relay_env, wait_until

# A stand-in relay: says it is ready once its SIGTERM handler is in place, then waits.
ON_TERM = {
    "drains": "lambda *_: sys.exit(0)",
    "fails": "lambda *_: sys.exit(3)",
    "hangs": "signal.SIG_IGN",
}


def stand_in(on_term: str, *, before: str = "pass") -> RelayProcess:
    script = (
        f"import signal, sys, time; {before}; signal.signal(signal.SIGTERM, {ON_TERM[on_term]});"
        " print('ready', flush=True); time.sleep(60)"
    )
    process = RelayProcess("-c", script, term_timeout_s=1.0, program=[sys.executable])
    assert wait_until(lambda: process.stdout().endswith("ready\n"), timeout=30), process.tail()
    return process


def test_a_relay_that_drains_on_sigterm_passes_the_clean_exit_check() -> None:
    with stand_in("drains") as process:
        assert process.stop() == 0
        assert not process.fallback_killed
        process.assert_clean_exit()


def test_a_relay_that_ignores_sigterm_is_killed_and_fails_the_check_with_its_log() -> None:
    with stand_in("hangs", before="print('last words', file=sys.stderr, flush=True)") as process:
        assert process.stop() == -signal.SIGKILL
        assert process.fallback_killed
        with pytest.raises(AssertionError, match=r"did not exit on SIGTERM and was killed:\nlast words"):
            process.assert_clean_exit()


def test_a_relay_that_exits_non_zero_on_sigterm_fails_the_check() -> None:
    with stand_in("fails") as process:
        assert process.stop() == 3
        with pytest.raises(AssertionError, match="exited with 3"):
            assert_clean_exits([process])


def test_a_relay_killed_on_purpose_is_accepted_only_as_killed() -> None:
    with stand_in("hangs") as crashed, stand_in("hangs") as frozen, stand_in("drains") as clean:
        crashed.kill()
        frozen.freeze()  # SIGSTOP: stop() ends in the fallback kill, which was the test's doing
        assert frozen.stop() == -signal.SIGKILL and frozen.fallback_killed
        assert clean.stop() == 0
        assert_clean_exits([crashed, frozen, clean])
    with stand_in("fails") as exited:
        exited.crashed = True  # as if killed on purpose, but it died of something else
        assert exited.stop() == 3
        with pytest.raises(AssertionError, match="was killed on purpose but exited with 3"):
            exited.assert_clean_exit()


def test_a_relay_still_running_fails_the_check() -> None:
    with stand_in("drains") as process, pytest.raises(AssertionError, match="is still running"):
        process.assert_clean_exit()


def test_a_chatty_relay_never_blocks_on_its_output() -> None:
    # Far more than a pipe holds (64 KiB on Linux), on both streams, before it is ready.
    chatter = "sys.stdout.write('o' * 2_000_000); sys.stderr.write('e' * 2_000_000)"
    with stand_in("drains", before=chatter) as process:
        assert process.stop() == 0
        assert process.stdout() == "o" * 2_000_000 + "ready\n"
        assert len(process.stderr()) == 2_000_000


def test_the_environment_holds_no_relay_setting_and_no_real_aws_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAY_DSN", "postgresql://somewhere/else")
    monkeypatch.setenv("RELAY_TEST_DSN", "postgresql://the/tests")
    monkeypatch.setenv("AWS_PROFILE", "production")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "real")
    env = relay_env(RELAY_SCHEMA="s")
    assert "RELAY_DSN" not in env and env["RELAY_TEST_DSN"] == "postgresql://the/tests"
    assert env["RELAY_SCHEMA"] == "s"
    assert "AWS_PROFILE" not in env and env["AWS_SECRET_ACCESS_KEY"] == "testing"
