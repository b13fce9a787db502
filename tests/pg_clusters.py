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

The silent variant (``silent_pair``) runs the primary inside a network namespace of its
own, joined to this host by a veth pair on a random 10.x.y.0/30, and the standby on
127.0.0.1 replicating from it over the veth. Its ``go_silent()`` is a partition, not a
crash: a blackhole route inside the namespace towards the host's side drops every packet
the primary sends, so the host's established connections see their data never
acknowledged (no RST, no FIN) and a new connect() never gets its SYN-ACK, while the
primary keeps running. (No netem or iptables on these machines: a route is what works.)
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from tests.services import require_services

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
    host: str = "127.0.0.1"  # the address it listens on, and clients and the standby use
    trusted: tuple[str, ...] = ("127.0.0.1",)  # client addresses pg_hba trusts, replication too
    netns: str | None = None  # the network namespace the postmaster runs in, if not this host's

    @property
    def conf_dir(self) -> Path:
        return CONF_ROOT / self.name

    @property
    def data_dir(self) -> Path:
        return Path("/var/lib/postgresql") / VERSION / self.name

    def dsn(self, database: str = "test") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{database}"

    def create(self) -> None:
        _run("pg_createcluster", VERSION, self.name, "-p", str(self.port), "--start-conf", "manual")
        settings = [
            f"listen_addresses = '{self.host}'",
            "fsync = off",
            "max_connections = 100",
            "wal_level = replica",
            "log_min_messages = warning",
        ]
        with (self.conf_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# relay failover test\n" + "\n".join(settings) + "\n")
        hba = self.conf_dir / "pg_hba.conf"
        trust = "".join(f"host all all {a}/32 trust\nhost replication all {a}/32 trust\n" for a in self.trusted)
        hba.write_text(trust + hba.read_text())

    def start(self) -> None:
        # Started inside its namespace, the postmaster (and every backend it forks) lives
        # there; stop and promote are signals and need no namespace.
        inside = ("ip", "netns", "exec", self.netns) if self.netns else ()
        _run(*inside, "pg_ctlcluster", VERSION, self.name, "start")

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
        """Both hosts, as a client of a managed failover names them: whichever accepts writes.
        The relays' DSN: it sets no timeout, so the relay's own (relay.db) are the ones at work."""
        return (
            f"postgresql://postgres@{self.primary.host}:{self.primary.port},"
            f"{self.standby.host}:{self.standby.port}/test?target_session_attrs=read-write"
        )

    @property
    def client_dsn(self) -> str:
        """The same hosts for the test's own connections and its producers, with the bounds a
        service would set (the relay's NETWORK_DEFAULTS): without them, a connection to a
        primary gone silent waits for the kernel's retransmissions (about 15 minutes), and a
        connect to it for the SYN retries (about 2)."""
        return self.dsn + "".join(f"&{k}={v}" for k, v in CLIENT_NETWORK.items())

    def fail_over(self) -> float:
        """Stop the primary with ``-m immediate`` and promote the standby; returns the
        ``time.monotonic()`` at which the primary was gone."""
        self.primary.stop_immediately()
        gone = time.monotonic()
        self.standby.promote()
        return gone


# What client_dsn adds (the values of relay.db.NETWORK_DEFAULTS, a shorter connect_timeout).
CLIENT_NETWORK = {
    "connect_timeout": "2",
    "tcp_user_timeout": "10000",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}


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
        "pg_basebackup", "-h", pair.primary.host, "-p", str(pair.primary.port), "-U", "postgres",
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


@dataclass
class Network:
    """A network namespace joined to this host by a veth pair on a /30 of its own: the host's
    side is ``host_ip``, the namespace's ``ns_ip``. Names carry a random suffix (at most 15
    characters, the kernel's limit for an interface)."""

    netns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str
    made: list[str] = field(default_factory=list)  # what delete() must remove

    @classmethod
    def new(cls) -> Network:
        suffix = uuid.uuid4().hex[:8]
        taken = _addresses_in_use()
        while True:
            net = ipaddress.ip_network(
                f"10.{random.randrange(256)}.{random.randrange(256)}.{random.randrange(0, 256, 4)}/30"
            )
            host_ip, ns_ip = (str(a) for a in net.hosts())
            if not any(ipaddress.ip_address(host_ip) in used for used in taken):
                return cls(f"rlyns_{suffix}", f"rlyh_{suffix}", f"rlyn_{suffix}", host_ip, ns_ip)

    def create(self) -> None:
        """Make the namespace and the link; the caller deletes them (:meth:`delete`), also
        when this fails halfway."""
        _run("ip", "netns", "add", self.netns)
        self.made.append("netns")
        _run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self.made.append("veth")
        _run("ip", "link", "set", self.ns_if, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        _run("ip", "link", "set", self.host_if, "up")
        inside = ("ip", "netns", "exec", self.netns)
        _run(*inside, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if)
        _run(*inside, "ip", "link", "set", self.ns_if, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")

    def blackhole(self) -> None:
        """From now on every packet from the namespace to this host vanishes."""
        _run("ip", "netns", "exec", self.netns, "ip", "route", "add", "blackhole", f"{self.host_ip}/32")

    def delete(self) -> None:
        # The veth goes with the namespace once nothing runs in it; deleted by name too, in
        # case something still does.
        if "veth" in self.made:
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30, check=False)
        if "netns" in self.made:
            subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, timeout=30, check=False)
        self.made.clear()


def _addresses_in_use() -> list[ipaddress.IPv4Network]:
    """The IPv4 networks this host's interfaces and routes already cover."""
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=30)
    nets = []
    for line in out.stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("local", "broadcast", "blackhole", "unreachable", "prohibit") and len(line.split()) > 1:
            word = line.split()[1]
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(word, strict=False))
    return [n for n in nets if n.prefixlen > 0]


def netns_usable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can (tried for real)."""
    if not shutil.which("ip"):
        return "needs iproute2's ip"
    probe = f"rlyprobe_{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot make a network namespace (ip netns add: {made.stderr.strip()})"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=30, check=False)
    return None


@dataclass
class SilentPair(ClusterPair):
    """A pair whose primary runs in ``net``'s namespace (see module doc)."""

    net: Network = field(default_factory=Network.new)

    def go_silent(self) -> float:
        """Partition the primary (it keeps running, unreachable) and promote the standby;
        returns the ``time.monotonic()`` at which the primary went silent."""
        self.net.blackhole()
        gone = time.monotonic()
        self.standby.promote()
        return gone


def new_silent_pair() -> SilentPair:
    base = f"relay_sl_{uuid.uuid4().hex[:8]}"
    net = Network.new()
    primary = Cluster(f"{base}_p", free_port(), host=net.ns_ip, trusted=(net.host_ip, "127.0.0.1"), netns=net.netns)
    return SilentPair(primary, Cluster(f"{base}_s", free_port()), net)


def drop_silent_pair(pair: SilentPair) -> None:
    # The primary first, and at once: a fast stop would wait for its walsender to reach a
    # standby it can no longer send to.
    subprocess.run(
        ["pg_ctlcluster", "-m", "immediate", VERSION, pair.primary.name, "stop"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    drop_pair(pair)
    pair.net.delete()


@pytest.fixture
def silent_pair() -> Iterator[SilentPair]:
    """A primary in a network namespace of its own and its synchronous standby on this
    host; the test makes the primary go silent (``go_silent``). Clusters, namespace and veth
    are removed after the test, pass or fail. Skips where network namespaces cannot be made
    (no root, a sandbox without CAP_SYS_ADMIN), but fails there in CI
    (RELAY_TEST_REQUIRE_SERVICES=1), as a missing service does."""
    why = netns_usable() if tools_available() else "needs Debian's PostgreSQL 15 cluster tools (pg_createcluster)"
    if why:
        if require_services():
            pytest.fail(f"silent_pair: {why}")
        pytest.skip(why)
    pair = new_silent_pair()
    try:
        pair.net.create()
        set_up(pair)
        yield pair
    finally:
        drop_silent_pair(pair)
