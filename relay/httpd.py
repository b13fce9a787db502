"""A small HTTP endpoint for Prometheus and orchestrators, on asyncio alone.

``GET /metrics``  the registry in the Prometheus text format (content type negotiated by
                  prometheus_client from the scraper's Accept header)
``GET /healthz``  200 ``ok`` while the process's event loop answers (liveness)
``GET /readyz``   200 ``ready`` when the readiness callback says so within
                  :data:`READY_TIMEOUT_S`; otherwise 503 and one line saying why
                  (what `relay start` counts as ready: :mod:`relay.readiness`)

It serves one request per connection and closes it; scrapers and probes expect no more.
Nothing it writes carries a password: readiness reasons go through :func:`relay.dsn.mask`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import psycopg
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from psycopg_pool import AsyncConnectionPool

from relay.db import readmodel
from relay.db.names import OutboxNames
from relay.db.session import connect
from relay.dsn import mask
from relay.errors import ConfigError, DatabaseUnavailable, shown

log = logging.getLogger("relay.httpd")


class Readiness(NamedTuple):
    """A readiness answer with a line per part (a process serving several outboxes)."""

    ok: bool
    reason: str
    details: tuple[str, ...] = ()


ReadyCheck = Callable[[], Awaitable[tuple[bool, str] | Readiness]]

# Kubernetes' default probe timeout is 1 s and its period 10 s; a check slower than 2 s is
# as good as failed, and must not pile up behind the next probe.
READY_TIMEOUT_S = 2.0
# A client that has not sent its request head within this long is dropped.
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_HEAD = 8192  # bytes; a scrape or probe request is a few hundred


async def serve(
    port: int,
    registry: CollectorRegistry,
    ready: ReadyCheck,
    host: str = "0.0.0.0",
) -> asyncio.Server:
    """Start serving on ``host:port`` (``port`` 0 picks a free one) and return the server;
    close it with ``server.close(); await server.wait_closed()``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _handle(reader, writer, registry, ready)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, asyncio.LimitOverrunError):
            pass  # the client went away or never finished its request
        except Exception:
            log.exception("metrics endpoint: unexpected error while answering a request")
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    try:
        server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_HEAD)
    except OSError as exc:  # the port is taken, the host does not resolve or is not ours
        reason = exc.strerror or str(exc) or type(exc).__name__
        raise ConfigError(f"cannot serve metrics on {shown(host)} port {port}: {reason}") from None
    bound = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets)
    log.info("serving /metrics, /healthz and /readyz on %s", bound)
    return server


async def _handle(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    registry: CollectorRegistry,
    ready: ReadyCheck,
) -> None:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        await _respond(writer, 400, b"bad request\n")
        return
    method, target, _ = parts
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    path = target.split("?", 1)[0]
    if method not in ("GET", "HEAD"):
        await _respond(writer, 405, b"method not allowed\n", extra={"Allow": "GET, HEAD"})
        return
    head_only = method == "HEAD"
    if path == "/metrics":
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        await _respond(writer, 200, encoder(registry), content_type=content_type, head_only=head_only)
    elif path == "/healthz":
        await _respond(writer, 200, b"ok\n", head_only=head_only)
    elif path == "/readyz":
        ok, reason, details = await _check(ready)
        body = (("ready\n" if ok else f"not ready: {reason}\n") + "".join(f"{d}\n" for d in details)).encode()
        await _respond(writer, 200 if ok else 503, body, head_only=head_only)
    else:
        await _respond(writer, 404, b"not found: try /metrics, /healthz or /readyz\n", head_only=head_only)


async def _check(ready: ReadyCheck) -> tuple[bool, str, list[str]]:
    """Run ``ready`` with a deadline; any failure becomes one masked line. A
    :class:`Readiness` adds detail lines (one per outbox), each masked and on one line."""
    try:
        result = await asyncio.wait_for(ready(), READY_TIMEOUT_S)
    except TimeoutError:
        return False, f"readiness check did not answer within {READY_TIMEOUT_S:g}s", []
    except Exception as exc:
        return False, _one_line(f"{type(exc).__name__}: {exc}"), []
    details: tuple[str, ...] = result.details if isinstance(result, Readiness) else ()
    return result[0], _one_line(result[1]), [_one_line(line) for line in details]


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return mask(lines[0] if lines else "")


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    *,
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
    extra: dict[str, str] | None = None,
) -> None:
    headers = {
        "Content-Type": content_type,
        "Content-Length": str(len(body)),
        "Connection": "close",
        "Cache-Control": "no-store",
        **(extra or {}),
    }
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    writer.write(head.encode("latin-1") + (b"" if head_only else body))
    await writer.drain()


def database_check(dsn: str, names: OutboxNames) -> ReadyCheck:
    """A readiness check that opens a connection and runs a zero-row read of the outbox
    table (so: the database answers, and the table exists and is readable). The reason on
    failure names host and database, never the password."""

    async def check() -> tuple[bool, str]:
        try:
            conn = await connect(dsn)
        except (DatabaseUnavailable, ConfigError) as exc:
            return False, f"database: {exc}"
        try:
            async with conn:
                await readmodel.ready_probe(conn, names)
        except psycopg.Error as exc:
            return False, f"database: {type(exc).__name__}: {exc}"
        return True, "database reachable"

    return check


def pool_check(pool: AsyncConnectionPool[Any], names: OutboxNames) -> ReadyCheck:
    """A relay's database readiness, through a connection of ``pool`` (so a probe opens no
    connection of its own; it waits at most :data:`READY_TIMEOUT_S` for one): a claim could
    run now (:func:`relay.db.readmodel.claim_probe`: not on a read-only database, nor with
    the role's grants revoked)."""

    async def check() -> tuple[bool, str]:
        try:
            async with pool.connection(timeout=READY_TIMEOUT_S) as conn:
                await readmodel.claim_probe(conn, names)
        except Exception as exc:  # a pool timeout is not a psycopg.Error
            return False, f"database: {type(exc).__name__}: {exc}"
        return True, "database reachable"

    return check


def all_ready(*checks: ReadyCheck) -> ReadyCheck:
    """Ready when every check is (database and broker): checks run concurrently and the
    first failing one, in the given order, supplies the reason."""

    async def check() -> tuple[bool, str]:
        results = await asyncio.gather(*(c() for c in checks), return_exceptions=True)
        reasons = []
        for result in results:
            if isinstance(result, BaseException):
                return False, f"{type(result).__name__}: {result}"
            ok, reason = result[0], result[1]
            if not ok:
                return False, reason
            reasons.append(reason)
        return True, "; ".join(reasons)

    return check
