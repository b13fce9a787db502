"""A scripted webhook receiver for the HTTP destination's tests, run as its own process:
``python -m tests.http_receiver`` with its settings in the environment.

It records every request it gets in PostgreSQL (``<schema>.requests``), verifies every
signature with the ``standardwebhooks`` package (someone else's implementation: the
oracle), and applies each Idempotency-Key's effect once (``<schema>.effects``, in the
order applied) when it answers 2xx. How it answers is scripted per event type: a status
for the first N requests of each key, a ``Retry-After``, a delay, a connection reset, a
redirect's ``Location``, a body that drips.

RECEIVER_DSN, RECEIVER_SCHEMA, RECEIVER_PORT; RECEIVER_SECRETS (whitespace-separated
whsec_ secrets: a request verifies when any of them verifies it); RECEIVER_SCRIPT (JSON:
``{"EventType": [{"status": 500, "times": 2, "retry_after": "1", "delay_s": 3, "reset":
true, "body": "...", "location": "/elsewhere?x=1", "drip_s": 3}]}``; ``drip_s`` sends the
status line and headers at once, then the body a byte at a time over that many seconds);
RECEIVER_CERT and RECEIVER_KEY for https, RECEIVER_CLIENT_CA to require a client
certificate signed by it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg
import pytest
from aiohttp import web
from psycopg import sql
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.pg_clusters import free_port
from tests.relay_process import RelayProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent


def create_tables(conn: psycopg.Connection[Any], schema: str) -> None:
    """The receiver's tables in ``schema`` (made by the test before it starts the process)."""
    conn.execute(
        sql.SQL(
            "CREATE TABLE {s}.requests (n bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
            " at timestamptz NOT NULL DEFAULT clock_timestamp(), idempotency_key text, outbox_id bigint,"
            " event_type text, aggregate_id text, aggregate_seq bigint, status integer NOT NULL,"
            " verified boolean, method text NOT NULL, path text NOT NULL, headers jsonb NOT NULL, body text NOT NULL);"
            " CREATE TABLE {s}.effects (applied bigint GENERATED ALWAYS AS IDENTITY,"
            " idempotency_key text PRIMARY KEY, outbox_id bigint, aggregate_id text, aggregate_seq bigint)"
        ).format(s=sql.Identifier(schema))
    )


class Receiver:
    """One receiver process and what it recorded."""

    def __init__(self, pg_dsn: str, tmp: Path, *, port: int | None = None, **env: str) -> None:
        self.pg_dsn = pg_dsn
        self.schema = f"r_{uuid.uuid4().hex[:12]}"
        self.port = port or free_port()
        self.https = "RECEIVER_CERT" in env
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.schema)))
            create_tables(conn, self.schema)
        self.log = tmp / f"receiver-{self.schema}.log"
        environ = {
            **os.environ, "PYTHONPATH": str(ROOT), "RECEIVER_DSN": pg_dsn, "RECEIVER_SCHEMA": self.schema,
            "RECEIVER_PORT": str(self.port), **env,
        }  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.http_receiver"], cwd=ROOT, env=environ, stdout=out, stderr=out
            )
        assert wait_until(lambda: "listening" in self.log.read_text() or self.proc.poll() is not None, timeout=30)
        assert self.proc.poll() is None, self.log.read_text()

    @property
    def url(self) -> str:
        return f"{'https' if self.https else 'http'}://127.0.0.1:{self.port}/hooks/orders"

    def query(self, text: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(self.schema)))
            return conn.execute(text).fetchall()

    def requests(self) -> list[dict[str, Any]]:
        cols = ("n", "at", "idempotency_key", "outbox_id", "event_type", "aggregate_id", "aggregate_seq", "status",
                "verified", "headers", "body")  # fmt: skip
        rows = self.query(f"SELECT {', '.join(cols)} FROM requests ORDER BY n")
        return [dict(zip(cols, row, strict=True)) for row in rows]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        with psycopg.connect(self.pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))


async def drip(
    request: web.Request, status: int, body: str, seconds: float, headers: dict[str, str]
) -> web.StreamResponse:
    """The status line and headers at once, then ``body`` a byte at a time spread over
    ``seconds``: a receiver that has answered but is slow to finish its answer."""
    response = web.StreamResponse(status=status, headers=headers)
    await response.prepare(request)
    data = body.encode()
    for i in range(len(data)):
        await asyncio.sleep(seconds / len(data))
        await response.write(data[i : i + 1])
    await response.write_eof()
    return response


def _verifier() -> list[Webhook]:
    return [Webhook(secret) for secret in os.environ.get("RECEIVER_SECRETS", "").split()]


async def main() -> None:
    script: dict[str, list[dict[str, Any]]] = json.loads(os.environ.get("RECEIVER_SCRIPT") or "{}")
    hooks = _verifier()
    seen: Counter[tuple[str, str]] = Counter()  # requests per (event type, key)
    conn = await psycopg.AsyncConnection.connect(os.environ["RECEIVER_DSN"], autocommit=True)
    lock = asyncio.Lock()
    s = sql.Identifier(os.environ["RECEIVER_SCHEMA"])
    record = sql.SQL(
        "INSERT INTO {}.requests (idempotency_key, outbox_id, event_type, aggregate_id, aggregate_seq, status,"
        " verified, method, path, headers, body) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    ).format(s)
    apply = sql.SQL(
        "INSERT INTO {}.effects (idempotency_key, outbox_id, aggregate_id, aggregate_seq) VALUES (%s, %s, %s, %s)"
        " ON CONFLICT (idempotency_key) DO NOTHING"
    ).format(s)

    def answer_for(event_type: str, key: str) -> dict[str, Any]:
        seen[(event_type, key)] += 1
        n = seen[(event_type, key)]
        for rule in script.get(event_type, []):
            times = rule.get("times")
            if times is None or n <= times:
                return rule
            n -= times
        return {"status": 200}

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = dict(request.headers)
        key = headers.get("Idempotency-Key", "")
        event_type = unquote(headers.get("Relay-Event-Type", ""))
        verified = None
        if hooks:
            verified = False
            for hook in hooks:
                try:
                    hook.verify(body, headers)
                    verified = True
                    break
                except WebhookVerificationError:
                    pass
        rule = answer_for(event_type, key)
        status = int(rule.get("status", 200))
        seq = headers.get("Relay-Aggregate-Seq")
        outbox_id = headers.get("Relay-Outbox-Id")
        aggregate_id = unquote(headers.get("Relay-Aggregate-Id", ""))
        async with lock:
            await conn.execute(
                record,
                (key, outbox_id, event_type, aggregate_id, seq, -1 if rule.get("reset") else status, verified,
                 request.method, request.path, json.dumps(headers), body.decode("utf-8", "replace")),
            )  # fmt: skip
            # A slow answer's effect is applied before it is late: what an idempotency key
            # is for. A reset comes before the effect, as a crash would.
            if 200 <= status < 300 and not rule.get("reset"):
                await conn.execute(apply, (key, outbox_id, aggregate_id, seq))
        if rule.get("delay_s"):
            await asyncio.sleep(float(rule["delay_s"]))
        if rule.get("reset"):
            transport = request.transport
            sock = transport.get_extra_info("socket") if transport else None
            if sock is not None:  # RST instead of FIN: a connection reset, as a crashed peer sends
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if transport is not None:
                transport.abort()
            raise asyncio.CancelledError
        extra = {"Retry-After": str(rule["retry_after"])} if "retry_after" in rule else {}
        if "location" in rule:
            extra["Location"] = str(rule["location"])
        if rule.get("drip_s"):
            return await drip(request, status, rule.get("body", "ok"), float(rule["drip_s"]), extra)
        return web.Response(status=status, text=rule.get("body", "ok"), headers=extra)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    context = None
    if os.environ.get("RECEIVER_CERT"):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(os.environ["RECEIVER_CERT"], os.environ.get("RECEIVER_KEY"))
        if os.environ.get("RECEIVER_CLIENT_CA"):
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(os.environ["RECEIVER_CLIENT_CA"])
    site = web.TCPSite(runner, "127.0.0.1", int(os.environ["RECEIVER_PORT"]), ssl_context=context)
    await site.start()
    print("listening", flush=True)
    await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main())


# Standard Webhooks signing secrets the tests sign with (a rotation's old and new).
SECRET_OLD = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECRET_NEW = "whsec_" + "c2VjcmV0LWZvci10aGUtbmV3LXJvdGF0aW9uLWtleQ=="


@pytest.fixture
def receivers(pg_dsn: str, tmp_path: Path) -> Iterator[Callable[..., Receiver]]:
    """``receivers(RECEIVER_SCRIPT=..., port=...)``: a receiver process, closed after the test."""
    made: list[Receiver] = []

    def make(**env: Any) -> Receiver:
        port = env.pop("port", None)
        receiver = Receiver(pg_dsn, tmp_path, port=port, **{k: str(v) for k, v in env.items()})
        made.append(receiver)
        return receiver

    yield make
    for receiver in made:
        receiver.close()


def http_relay(names: Any, url: str, *extra: str, env: dict[str, str], relays: list[RelayProcess]) -> RelayProcess:
    """`relay start --broker http` on outbox ``names`` to ``url``, with short leases,
    timeouts and backoffs for tests; appended to ``relays``."""
    relay = RelayProcess(
        "start", "--schema", names.schema, "--broker", "http", "--url", url,
        "--workers", "2", "--batch-size", "20", "--lease", "5s", "--publish-timeout", "3s",
        "--poll-interval", "100ms", "--backoff-base", "100ms", "--backoff-cap", "300ms", *extra,
        env=env,
    )  # fmt: skip
    relays.append(relay)
    return relay
