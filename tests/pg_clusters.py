"""A primary and a synchronous standby of our own on this machine, for the failover test.

Debian's cluster tools (``pg_createcluster``, ``pg_ctlcluster``, ``pg_dropcluster``) make
two clusters on spare ports, named ``relay_fo_<random>_p`` and ``_s``; the standby is a
``pg_basebackup -R`` of the primary, which names it its synchronous standby, so a COMMIT
returns only once the standby has the commit (what a managed failover with synchronous
replication promises). The machine's own clusters are never touched, and both clusters are
dropped when the test ends, pass or fail.

Autovacuum stays on, as on a managed database; fsync is off because the clusters' data is
thrown away afterwards and ``stop -m immediate`` kills PostgreSQL, not the operating
system, so nothing written to the kernel is lost by it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

VERSION = "15"
CONF_ROOT = Path("/etc/postgresql") / VERSION


def tools_available() -> bool:
    return all(shutil.which(tool) for tool in ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster", "runuser")) and (
        CONF_ROOT.is_dir()
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")


@dataclass
class Cluster:
    name: str
    port: int

    @property
    def conf_dir(self) -> Path:
        return CONF_ROOT / self.name

    @property
    def data_dir(self) -> Path:
        return Path("/var/lib/postgresql") / VERSION / self.name

    def dsn(self, database: str = "test") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create(self) -> None:
        _run("pg_createcluster", VERSION, self.name, "-p", str(self.port), "--start-conf", "manual")
        settings = [
            "listen_addresses = '127.0.0.1'",
            "fsync = off",
            "max_connections = 100",
            "wal_level = replica",
            "log_min_messages = warning",
        ]
        with (self.conf_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# relay failover test\n" + "\n".join(settings) + "\n")
        hba = self.conf_dir / "pg_hba.conf"
        trust = "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
        hba.write_text(trust + hba.read_text())

    def start(self) -> None:
        _run("pg_ctlcluster", VERSION, self.name, "start")

    def stop_immediately(self) -> None:
        """The crash of a failover: no shutdown checkpoint, every session cut at once."""
        _run("pg_ctlcluster", "-m", "immediate", VERSION, self.name, "stop")

    def promote(self) -> None:
        _run("pg_ctlcluster", VERSION, self.name, "promote")

    def drop(self) -> None:
        subprocess.run(
            ["pg_dropcluster", "--stop", VERSION, self.name], capture_output=True, text=True, timeout=120, check=False
        )


@dataclass
class ClusterPair:
    primary: Cluster
    standby: Cluster

    @property
    def dsn(self) -> str:
        """Both hosts, as a client of a managed failover names them: whichever accepts writes."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}/test"
            "?target_session_attrs=read-write"
        )

    def fail_over(self) -> float:
        """Stop the primary with ``-m immediate`` and promote the standby; returns the
        ``time.monotonic()`` at which the primary was gone."""
        self.primary.stop_immediately()
        gone = time.monotonic()
        self.standby.promote()
        return gone


def _wait_for(check: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except psycopg.OperationalError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def new_pair() -> ClusterPair:
    """Names and ports for two clusters not made yet."""
    base = f"relay_fo_{uuid.uuid4().hex[:8]}"
    return ClusterPair(Cluster(f"{base}_p", free_port()), Cluster(f"{base}_s", free_port()))


def set_up(pair: ClusterPair) -> None:
    """Create, start and connect the two clusters; the caller drops them (:func:`drop_pair`),
    also when this fails halfway."""
    pair.primary.create()
    pair.primary.start()
    with psycopg.connect(pair.primary.dsn("postgres"), autocommit=True) as conn:
        conn.execute("CREATE DATABASE test")
    pair.standby.create()
    # The standby's data directory becomes a copy of the primary's, with -R writing the
    # primary_conninfo and standby.signal that make it follow.
    for child in pair.standby.data_dir.iterdir():
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
    _run(
        "runuser", "-u", "postgres", "--",
        "pg_basebackup", "-h", "127.0.0.1", "-p", str(pair.primary.port), "-U", "postgres",
        "-D", str(pair.standby.data_dir), "-R", "-X", "stream", "-c", "fast",
    )  # fmt: skip
    pair.standby.start()
    # Only now: set before the standby exists, every commit (CREATE DATABASE too) would wait
    # for it. Set after the base backup, the standby's copy says nothing of a synchronous
    # standby: once promoted it has none, and would otherwise wait for one at every COMMIT.
    with psycopg.connect(pair.primary.dsn("postgres"), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        conn.execute("SELECT pg_reload_conf()")

    def synchronous() -> bool:
        with psycopg.connect(pair.primary.dsn("postgres"), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").fetchone()
            return bool(row and row[0])

    _wait_for(synchronous, "the standby to replicate synchronously")


def drop_pair(pair: ClusterPair) -> None:
    pair.standby.drop()
    pair.primary.drop()


@pytest.fixture
def pg_pair() -> Iterator[ClusterPair]:
    """A primary with a synchronous standby, both dropped after the test (see module doc)."""
    if not tools_available():
        pytest.skip("needs Debian's PostgreSQL 15 cluster tools (pg_createcluster) and root")
    pair = new_pair()
    try:
        set_up(pair)
        yield pair
    finally:
        drop_pair(pair)
