"""The network defaults every relay connection gets (relay.db.network_defaults): applied
unless the DSN, in either form, sets the parameter itself."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator

import pytest

from relay.db.session import NETWORK_DEFAULTS, network_defaults


def test_a_dsn_without_them_gets_every_default() -> None:
    assert network_defaults("postgresql://postgres@127.0.0.1:5432/test") == NETWORK_DEFAULTS


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u@a:1,b:2/db?target_session_attrs=read-write&tcp_user_timeout=3000&keepalives_idle=30",
        "host=a,b port=1,2 dbname=db tcp_user_timeout=3000 keepalives_idle=30",
    ],
)
def test_the_dsns_own_values_win(dsn: str) -> None:
    got = network_defaults(dsn)
    assert "tcp_user_timeout" not in got and "keepalives_idle" not in got
    assert got["keepalives_interval"] == NETWORK_DEFAULTS["keepalives_interval"]
    assert got["connect_timeout"] == NETWORK_DEFAULTS["connect_timeout"]


def test_pgconnect_timeout_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "2")
    assert "connect_timeout" not in network_defaults("postgresql://u@h/db")


def test_a_malformed_dsn_is_left_to_the_connection_attempt() -> None:
    assert network_defaults("host='unterminated") == NETWORK_DEFAULTS


async def test_a_relay_connection_carries_them(pg_dsn: str) -> None:
    from relay.db.session import connect

    conn = await connect(pg_dsn + ("&" if "?" in pg_dsn else "?") + "keepalives_idle=42")
    async with conn:
        params = conn.info.get_parameters()
    assert params["keepalives_idle"] == "42"
    assert params["tcp_user_timeout"] == NETWORK_DEFAULTS["tcp_user_timeout"]
    assert params["keepalives"] == "1"


async def test_the_kernel_gets_them_on_every_pool_connection(pg_dsn: str) -> None:
    from relay.db.session import open_pool

    pool = await open_pool(pg_dsn, size=1)
    try:
        async with pool.connection() as conn:
            sock = socket.socket(fileno=os.dup(conn.fileno()))
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 10
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 5
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 10000
            finally:
                os.close(sock.detach())
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def silent_host() -> AsyncIterator[int]:
    """A port that accepts TCP connections and never answers (a frozen server, or a dead
    primary's address behind a load balancer that still accepts): the kernel acknowledges
    everything, so only a timeout of the client's own gets it unstuck."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield int(server.sockets[0].getsockname()[1])
    finally:
        server.close()
        for writer in held:
            writer.transport.abort()
        await server.wait_closed()


async def test_a_silent_first_host_costs_connect_timeout_then_the_next_host_answers(pg_dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from relay.db.session import CONNECT_TIMEOUT_S, connect

    given = conninfo_to_dict(pg_dsn)
    async with silent_host() as port:
        two_hosts = make_conninfo(
            pg_dsn, host=f"127.0.0.1,{given.get('host', '127.0.0.1')}", port=f"{port},{given.get('port', 5432)}"
        )
        started = time.monotonic()
        conn = await asyncio.wait_for(connect(two_hosts), timeout=CONNECT_TIMEOUT_S * 3)
        took = time.monotonic() - started
        async with conn:
            assert conn.info.port == int(given.get("port", 5432))
    assert CONNECT_TIMEOUT_S - 0.5 <= took <= CONNECT_TIMEOUT_S + 3, took
