"""CPU time from /proc, for the benchmarks' "what it cost" columns (Linux only)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """utime + stime of one process in seconds; 0 when it is gone or cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def rss_mb(pid: int) -> float:
    """The resident memory of one process in MiB (VmRSS); 0 when it cannot be read."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0.0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def pids_named(*names: str) -> list[int]:
    """Every process whose command name (``comm``) is one of ``names``: postgres, beam.smp."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in names:
                    out.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue  # exited meanwhile
    return out


def command_cpu(*names: str) -> float:
    """CPU seconds used so far by every process named one of ``names`` (those still running)."""
    return sum(process_cpu(pid) for pid in pids_named(*names))


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # up to steal; guest time is already inside user
    return (total - idle) / CLK_TCK, total / CLK_TCK


class CpuMeter:
    """CPU seconds spent by every process named one of ``names`` between ``start`` and
    ``stop``, counting processes that start or exit meanwhile (a database connection
    closed at the end of a run takes its backend's CPU with it from a plain before/after
    sum): each process is sampled every ``interval`` seconds, and one that exits keeps
    what it had used at its last sample."""

    def __init__(self, *names: str, interval: float = 0.1) -> None:
        self.names, self.interval = names, interval
        self._first: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for pid in pids_named(*self.names):
            used = process_cpu(pid)
            if used:
                self._last[pid] = used

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def start(self) -> CpuMeter:
        for pid in pids_named(*self.names):
            self._first[pid] = process_cpu(pid)
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self._sample()
        return sum(used - self._first.get(pid, 0.0) for pid, used in self._last.items())
