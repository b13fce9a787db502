"""Opening connections to PostgreSQL with errors a person can act on."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from relay.db.names import OutboxNames
from relay.db.statements import migrations
from relay.db.text import set_up_text
from relay.dsn import describe_dsn, mask
from relay.errors import ConfigError, DatabaseUnavailable

# What the dispatch path treats as a passing loss of its session, retried like an outage:
# the server or the network went away (OperationalError; a statement cancelled by
# statement_timeout is one too, QueryCanceled), or PostgreSQL ended a session left idle
# inside a transaction past idle_in_transaction_session_timeout, which psycopg raises at
# the next statement as an InternalError subclass.
TRANSIENT_DB_ERRORS: tuple[type[psycopg.Error], ...] = (
    psycopg.OperationalError,
    psycopg.errors.IdleInTransactionSessionTimeout,
)
APPLICATION_NAME = "outbox-relay"

# What every relay connection uses unless its DSN sets the parameter itself (libpq's names).
# A failover or a host that vanishes leaves a connection half-open: nothing closes it, and
# a worker waiting on it would wait forever. These bound that wait:
# * connect_timeout: per host of a multi-host DSN, so a dead first host costs 5 s before
#   the next is tried, not the kernel's two minutes of SYN retries.
# * tcp_user_timeout: a query sent to a host that stopped acknowledging fails after 10 s
#   (well inside the default lease of 60 s, so the retry lands on the new primary before the lease
#   runs out); it counts only unacknowledged data, never a slow query.
# * keepalives: a connection waiting for an answer (or the wake-up listener, idle by
#   design) sends its first probe after 10 s of silence; Linux then ends it at the next
#   probe, 5 s later, because tcp_user_timeout (10 s) has passed by then (tcp(7): it
#   overrides keepalives_count): 15 s, as tests/test_faults.py's silent primary measured.
#   Without tcp_user_timeout it would be 10 + 3 x 5 = 25 s.
CONNECT_TIMEOUT_S = 5
NETWORK_DEFAULTS: dict[str, str] = {
    "connect_timeout": str(CONNECT_TIMEOUT_S),
    "tcp_user_timeout": "10000",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "5",
    "keepalives_count": "3",
}
# The environment variables libpq reads for those parameters: set, they win over our default.
_ENVIRONMENT = {"connect_timeout": "PGCONNECT_TIMEOUT"}


def network_defaults(dsn: str) -> dict[str, str]:
    """The connection parameters of ``NETWORK_DEFAULTS`` that ``dsn`` (or libpq's environment)
    does not set: keyword arguments for psycopg, which would otherwise override the DSN's own."""
    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        given = {}  # the connection attempt reports the malformed DSN in its own words
    return {
        key: value
        for key, value in NETWORK_DEFAULTS.items()
        if key not in given and not os.environ.get(_ENVIRONMENT.get(key, ""), "")
    }


async def connect(dsn: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    """One autocommit connection; failures become DatabaseUnavailable naming host and database.

    Its text is UTF-8 whatever the database's encoding (:mod:`relay.db.text`). It serves the
    operator commands, the wake-up listener, prune and probes, none of which publishes: bytes
    of a SQL_ASCII database that are not UTF-8 are shown as ``\\xe9`` ("readable").
    """
    where = describe_dsn(dsn)
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, **{**network_defaults(dsn), **kwargs})
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {where}: {_reason(exc)}") from None
    except psycopg.ProgrammingError as exc:  # malformed options inside an otherwise parseable DSN
        raise ConfigError(f"invalid --dsn: {mask(_reason(exc))}") from None
    try:
        await set_up_text(conn, "readable")
    except psycopg.OperationalError as exc:
        await conn.close()
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {where}: {_reason(exc)}") from None
    return conn


async def connect_beside(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncConnection[Any]:
    """Another autocommit connection (as :func:`connect` opens it) to the server, database
    and role ``conn`` is connected to: for a lock that must be held in a transaction while
    ``conn`` runs what cannot run in one (``DETACH ... CONCURRENTLY``)."""
    password = conn.info.password
    return await connect(make_conninfo(conn.info.dsn, **({"password": password} if password else {})))


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    # libpq prefixes the reason with "connection failed: connection to server at ..."; keep the end.
    text = lines[-1] if lines else type(exc).__name__
    return mask(text.split(": ", 1)[-1] if text.startswith("connection to server") else text)


@dataclass(frozen=True)
class SessionLimits:
    """How long PostgreSQL lets one of the relay's sessions run a statement, and sit idle
    inside a transaction, before it cancels the statement or ends the session (zero: no
    limit). The relay's transactions last milliseconds; these bound what a relay bug or a
    stuck network can hold: row locks, and the xmin horizon that vacuum waits behind.
    Defaults: ``--statement-timeout`` and ``--idle-in-transaction-timeout`` (relay.config)."""

    statement_timeout: timedelta = timedelta(seconds=30)
    idle_in_transaction_timeout: timedelta = timedelta(seconds=10)


def _ms(value: timedelta) -> str:
    # PostgreSQL reads a bare number as milliseconds; under 1 ms would round to 0 (off).
    ms = int(value / timedelta(milliseconds=1))
    return str(max(ms, 1) if value > timedelta(0) else 0)


async def configure_session(conn: psycopg.AsyncConnection[Any], limits: SessionLimits | None = None) -> None:
    """How every session of the relay's pool is set up, whatever the database's defaults.

    * READ COMMITTED: the ingest relies on each statement taking a new snapshot (see the
      ingest in sql/queries.sql), and the heads trigger on seeing rows a concurrent ingest
      numbered.
    * No JIT: the relay runs short statements over a few thousand rows at most, and their
      cost estimates can still cross jit_above_cost; compiling them took 70 ms of a 1 ms
      ingest in bench_db. No statement of the relay's gains from it.
    * Text in UTF-8 whatever the database's encoding; in a SQL_ASCII database, bytes that
      are not UTF-8 are kept exactly, so the store can send their row to dead alone
      (:mod:`relay.db.text`).
    * ``limits`` (:class:`SessionLimits`; its defaults when None): statement_timeout and
      idle_in_transaction_session_timeout, so PostgreSQL itself ends what runs too long.
    """
    limits = limits or SessionLimits()
    await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
    await conn.execute(
        "SELECT set_config('jit', 'off', false), set_config('statement_timeout', %s, false),"
        " set_config('idle_in_transaction_session_timeout', %s, false)",
        (_ms(limits.statement_timeout), _ms(limits.idle_in_transaction_timeout)),
    )
    await set_up_text(conn, "exact")


# How long one pool connection attempt keeps trying, every FAILOVER_RETRY_EVERY_S, before it
# fails and psycopg_pool's own backoff (1 s, then 2 s, 4 s ... apart) takes over. A failover
# refuses connections for a moment (the old primary gone, the standby not yet promoted):
# without this, the pool's first retry came a whole second later, and its second, three.
FAILOVER_RETRY_S = 3.0
FAILOVER_RETRY_EVERY_S = 0.1


# A pooled connection handed back healthy less than this long ago is handed out again
# without the pool's check (an empty statement, a round trip). Busy workers take a
# connection two or three times a batch: the check was a third of their round trips and
# a tenth of the relay's CPU. A connection that died in between fails its first
# statement instead, which every caller already takes as a transient database error
# (the worker retries after its backoff; the pool discards the broken connection).
RECENTLY_USED_S = 1.0


class _PoolConnection(psycopg.AsyncConnection[Any]):
    """A pool connection whose connect retries briefly (``FAILOVER_RETRY_S``), and which
    remembers when it was last handed back to the pool healthy."""

    returned_at: float = float("-inf")

    @classmethod
    async def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
        give_up = time.monotonic() + FAILOVER_RETRY_S
        while True:
            try:
                return await super().connect(conninfo, **kwargs)
            except psycopg.OperationalError:
                if time.monotonic() + FAILOVER_RETRY_EVERY_S >= give_up:
                    raise
                await asyncio.sleep(FAILOVER_RETRY_EVERY_S)


async def _check_unless_recent(conn: psycopg.AsyncConnection[Any]) -> None:
    if time.monotonic() - getattr(conn, "returned_at", float("-inf")) >= RECENTLY_USED_S:
        await AsyncConnectionPool.check_connection(conn)


async def _mark_returned(conn: psycopg.AsyncConnection[Any]) -> None:
    """The pool's reset callback, run as a connection comes back (after the pool rolled
    back a transaction left open). One that is broken is discarded after this, never
    handed out again, so the mark only ever speaks for a connection that answered."""
    if isinstance(conn, _PoolConnection):
        conn.returned_at = time.monotonic()


async def open_pool(
    dsn: str, size: int, limits: SessionLimits | None = None, *, least: int | None = None, probe: bool = True
) -> AsyncConnectionPool[Any]:
    """A pool of ``size`` autocommit connections, checked by one real connection first
    (unless not ``probe``: a database that is down then only makes its users wait), each
    session set up by :func:`configure_session` with ``limits``. ``least``: keep only this
    many open while idle (connections beyond it are closed after a minute unused)."""
    if probe:
        await (await connect(dsn)).close()
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        min_size=size if least is None else min(least, size),
        max_size=size,
        max_idle=60.0,
        open=False,
        # The application name lets operators (and the fault tests) find the relay's
        # sessions in pg_stat_activity.
        kwargs={"autocommit": True, "application_name": APPLICATION_NAME, **network_defaults(dsn)},
        # A connection idle for a while is checked before it is handed out, and replaced
        # if it is broken; one handed back just now is not (RECENTLY_USED_S).
        check=_check_unless_recent,
        reset=_mark_returned,
        configure=partial(configure_session, limits=limits),
        name="relay",
        connection_class=_PoolConnection,
    )
    # Not waiting for the pool to fill: the probe above already told a wrong DSN or an
    # unreachable server apart (one line, exit 2). Sessions that fail after that (dropped
    # by a failover or pg_terminate_backend) are a passing fault; whoever asks the pool for
    # a connection waits for it, and the relay's start-up retries (relay.runner).
    await pool.open(wait=False)
    return pool


async def check_schema(conn: psycopg.AsyncConnection[Any], names: OutboxNames) -> None:
    """Fail with a clear line unless the outbox carries exactly the migrations this release
    ships: fewer, and `relay migrate` is due; more, and this relay is older than the schema."""
    ledger = f'"{names.schema}"."{names.table}_migrations"'
    cur = await conn.execute("SELECT to_regclass(%s) IS NOT NULL", (ledger,))
    row = await cur.fetchone()
    if not row or not row[0]:
        raise ConfigError(f"outbox {names.qualified} is not set up: run `relay migrate` first")
    cur = await conn.execute(sql.SQL("SELECT version FROM {}").format(names.identifier("q_migrations")))
    applied = {int(r[0]) for r in await cur.fetchall()}
    known = {version: f"{version:04d}_{name}" for version, name, _ in migrations()}
    missing = sorted(set(known) - applied)
    if missing:
        raise ConfigError(f"outbox {names.qualified} lacks migration {known[missing[0]]}: run `relay migrate` first")
    newer = sorted(applied - set(known))
    if newer:
        raise ConfigError(
            f"outbox {names.qualified} has migration {newer[-1]:04d}, newer than this relay knows"
            f" (up to {max(known):04d}): upgrade outbox-relay on this host"
        )
