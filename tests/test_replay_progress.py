"""`relay replay`'s progress: a bar with rate and ETA on a terminal, and otherwise one log
line per 10,000 messages (the command's own output, not the engine's)."""

from __future__ import annotations

import io
import logging

import pytest

from relay.cli.replay import LOG_EVERY, _Progress
from relay.replay import ReplayReport


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def report(published: int, total: int, elapsed: float) -> ReplayReport:
    r = ReplayReport(run_id="run-1", total=total, published=published)
    r.finished = r.started + elapsed
    return r


def test_on_a_terminal_a_bar_with_rate_and_eta() -> None:
    out = Terminal()
    progress = _Progress(out, total=1000)
    progress(report(250, 1000, 0.5))
    drawn = out.getvalue()
    assert drawn.startswith("\r[#######.......................] 250/1,000 500 msg/s ETA 1.5s"), drawn
    progress(report(1000, 1000, 2.0))  # the last one is drawn whatever the time since the last
    assert "1,000/1,000" in out.getvalue().rsplit("\r", 1)[-1]
    progress.close()
    assert out.getvalue().endswith("\n")


def test_without_a_terminal_one_log_line_per_10000(caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    progress = _Progress(out, total=25_000)
    with caplog.at_level(logging.INFO, logger="relay.replay"):
        for done in range(0, 25_001, 500):
            progress(report(done, 25_000, 1.0 + done / 1000))
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" settled")[0] for line in lines] == [
        "replay run-1: 10,000 of 25,000",
        "replay run-1: 20,000 of 25,000",
        "replay run-1: 25,000 of 25,000",
    ]
    assert LOG_EVERY == 10_000
    assert out.getvalue() == "", "no bar without a terminal"
