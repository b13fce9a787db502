"""The outbox store: the only code that names queries and turns rows into messages.

The dispatch loop calls :meth:`OutboxStore.claim` and :meth:`OutboxStore.finalize` and
never sees SQL. Each call borrows a pooled connection for one short transaction and
returns it before any broker call is made.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.abc import Buffer
from psycopg.adapt import Loader
from psycopg_pool import AsyncConnectionPool

from relay.db.commit_order import ingest_by_id
from relay.db.names import OutboxNames
from relay.db.session import SessionLimits, configure_session
from relay.db.statements import named_queries
from relay.db.text import SQL_ASCII, not_utf8, not_utf8_bytes, readable, server_encoding, storable
from relay.dsn import mask
from relay.errors import first_line
from relay.message import Decision, OutboxMessage, SpooledPayload, decode_headers

log = logging.getLogger("relay.db.dispatch")

# Committed producer transactions one ingest numbers at most. A backlog (relays stopped
# while producers wrote) is numbered in turns of this size, and a worker whose ingest came
# back full runs the next one at once; a turn of 5,000 single-event transactions takes
# tens of milliseconds, short enough for the claim transaction that carries it.
INGEST_TRANSACTIONS = 5000

# Payload bytes one claim leases at most (relay start --batch-bytes). A worker holds its
# batch several times over for a moment (libpq's buffer and result, the bodies, the
# broker client's frames), and a pooled connection keeps a buffer as large as the largest
# result it read. Peak RSS of `relay start --workers 4 --broker rabbitmq` at 4 MiB, 42 MB
# of it the idle process: 90 MB draining 10 MB payloads (over the budget: one at a time),
# 91 MB with 3.9 MB ones (four in flight), 74 MB with 1.9 MB ones (two per batch), 54 MB
# with 40 kB ones (100 per batch); at 8 MiB, 3.9 MB payloads (two per batch) took 123 MB
# and 7.5 MB ones 136 MB. Batches of 100 events of up to 40 kB each still fill.
DEFAULT_BATCH_BYTES = 4 * 1024 * 1024
# Whether the claim-check stores a payload of this event type and size (ClaimChecks.stores):
# only such a payload may be read into a file, for only the claim-check reads that file.
Spools = Callable[[str, int], bool]
# Bytes of a spooled payload read from PostgreSQL at a time (OutboxStore._spool): with a
# 100 MB payload, 4 MiB slices peaked at 96 MB RSS in 3.0 s, 1 MiB at 82 MB in 4.8 s.
SPOOL_SLICE = 4 * 1024 * 1024
# A smaller budget is taken for a typo ("8" meaning 8 MiB): it would claim one row at a
# time. PostgreSQL's own field limit is 1 GB, so a larger budget never binds anyway.
MIN_BATCH_BYTES = 64 * 1024
MAX_BATCH_BYTES = 1024 * 1024 * 1024


@dataclass(frozen=True)
class Reaped:
    """A row whose lease expired: back to 'pending', or to 'dead' if that was its last attempt."""

    id: int
    aggregate_id: str
    event_type: str
    lease_version: int
    attempts: int
    status: str

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Reaped:
        """A ``reap_expired`` row. Only logged and counted: text that is not UTF-8
        (SQL_ASCII) is shown escaped, so a metrics label or a log line can always be written."""
        outbox_id, aggregate_id, event_type, lease_version, attempts, status = row
        return cls(outbox_id, readable(aggregate_id), readable(event_type), lease_version, attempts, status)


@dataclass(frozen=True)
class Unreadable:
    """A claimed row that cannot become a message, so it goes to dead alone: its text is
    not UTF-8, which only a SQL_ASCII database lets in (it stores bytes unchecked), or its
    producer headers are refused (relay.message.producer_headers)."""

    message: OutboxMessage  # its text with the offending bytes as \xe9, for logs and metrics
    reason: str


@dataclass(frozen=True)
class Claim:
    messages: list[OutboxMessage]
    reaped: list[Reaped]
    numbered: int = 0  # ordered rows the ingest numbered in this claim's transaction
    ingest_full: bool = False  # the ingest took a whole turn: more committed rows wait
    unreadable: list[Unreadable] = field(default_factory=list)  # leased, to be finalized as dead


class IngestRaced(Exception):
    """A row the ingest was numbering changed under it (someone updated an unnumbered row
    by hand at that moment). Its transaction is rolled back, so no number is lost."""


class OutboxStore:
    """Claims and finalizes rows of one outbox table."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        names: OutboxNames,
        limits: SessionLimits | None = None,
        *,
        spools: Spools | None = None,
    ) -> None:
        """``spools(event_type, payload_bytes)``: whether the claim-check stores such a
        payload; one it does, over a claim's byte budget, is read into a temporary file,
        not memory (SpooledPayload)."""
        self.pool = pool
        self.names = names
        # The session limits the pool's sessions got, for the connections made beside it.
        self.limits = limits
        self.spools = spools
        # Render every statement once: identifiers are fixed for the life of the store.
        self._sql = {name: names.render(text) for name, text in named_queries().items()}
        self._sql["ingest_by_id"] = names.render(ingest_by_id(named_queries()["ingest"]))

    def query(self, name: str) -> psycopg.sql.Composed:
        return self._sql[name]

    async def claim(
        self,
        *,
        owner: str,
        batch: int,
        lease: timedelta,
        max_attempts: int,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        oversize: bool = True,
        housekeeping: bool = True,
    ) -> Claim:
        """Lease up to ``batch`` rows, and up to ``batch_bytes`` of payload: ready heads of
        ordered aggregates and ready unordered rows, the oldest ready first whichever kind
        they are, while their total stays within the budget. With ``oversize``, the first
        row is taken whatever its size (so a message larger than the budget is claimed
        alone); without, rows over the budget are passed over, for a claim that may take
        them.

        With ``housekeeping``, first returns expired leases (to 'pending', or 'dead' on the
        last attempt) and numbers newly committed ordered rows (the ingest), in the claim's
        transaction; without (a busy process runs them only every so often, the heads
        trigger keeping numbered aggregates moving meanwhile), the claim is one statement
        on its own, atomic without a transaction around it.
        """
        params: dict[str, Any] = {
            "owner": owner,
            "lease": lease,
            "max_attempts": max_attempts,
            "batch": batch,
            "budget": batch_bytes,
            "oversize": oversize,
        }
        reaped: list[Reaped] = []
        numbered, ingest_full = 0, False
        try:
            async with self.pool.connection() as conn:
                async with conn.transaction() if housekeeping else _NO_TRANSACTION:
                    if housekeeping:
                        cur = await conn.execute(self._sql["reap_expired"], params)
                        reaped = [Reaped.from_row(row) for row in await cur.fetchall()]
                        numbered, ingest_full = await self._ingest(conn)
                    async with payload_cursor(conn) as cur:
                        await cur.execute(self._sql["claim"], params)
                        rows = await cur.fetchall()
                exact = server_encoding(conn) == SQL_ASCII  # text unchecked: look at every row
        except IngestRaced as exc:
            log.warning("%s; nothing was claimed or numbered this time, the next claim tries again", exc)
            return Claim(messages=[], reaped=[])
        messages: list[OutboxMessage] = []
        unreadable: list[Unreadable] = []
        for row in rows:
            body, spooled = row[_PAYLOAD], None
            if body is None and self.spools is not None and self.spools(row[3], row[_BYTES]):
                spooled = await self._spool(row[_ID], row[_LEASE_VERSION])
                if spooled is None:
                    continue
                body = b""
            elif body is None:  # over the budget: claimed alone, its payload read now
                body = await self._oversized(row[_ID], row[_LEASE_VERSION])
                if body is None:
                    continue
            message = message_from_row(row, body, exact=exact)
            if spooled is not None and isinstance(message, OutboxMessage):
                message = replace(message, spooled=spooled)
            if isinstance(message, Unreadable):
                unreadable.append(message)
            else:
                messages.append(message)
        messages.sort(key=lambda m: m.id)  # RETURNING order is not guaranteed
        return Claim(
            messages=messages, reaped=reaped, numbered=numbered, ingest_full=ingest_full, unreadable=unreadable
        )

    async def _oversized(self, outbox_id: int, lease_version: int) -> bytes | None:
        """The message of a claimed row whose payload is over the budget, its payload read
        on a connection of its own, closed afterwards: libpq keeps a connection's input
        buffer at the largest message it ever received, so a pooled connection that read
        a 10 MB payload once would hold 10 MB or more for the rest of its life."""
        params = {"id": outbox_id, "lease_version": lease_version}
        async with await _connect_like(self.pool, self.limits) as conn, payload_cursor(conn) as cur:
            await cur.execute(self._sql["payload_of"], params)
            found = await cur.fetchone()
        if found is None:  # taken over already (its lease cannot have run out in between)
            log.warning("claimed row %d was taken over before its payload was read", outbox_id)
            return None
        (payload,) = found
        return bytes(payload)

    async def _spool(self, outbox_id: int, lease_version: int) -> SpooledPayload | None:
        """The payload of a claimed row over the claim-check's threshold, in a file
        (:func:`spool_payload`); on a connection of its own, closed afterwards, as
        :meth:`_oversized`."""
        params = {"id": outbox_id, "lease_version": lease_version}
        async with await _connect_like(self.pool, self.limits) as conn:
            spooled = await spool_payload(conn, self._sql, "payload_spool", params)
        if spooled is None:
            log.warning("claimed row %d was taken over before its payload was read", outbox_id)
        return spooled

    async def _ingest(self, conn: psycopg.AsyncConnection[Any]) -> tuple[int, bool]:
        """Number what has committed, if no other relay is numbering right now. Two
        statements on purpose: the lock first, then the numbering on a snapshot taken
        after the lock was granted, so it sees every number the previous holder wrote.
        Returns (rows numbered, whether the turn was full)."""
        await conn.execute(self._sql["ingest_plans"])
        cur = await conn.execute(self._sql["ingest_lock"])
        turn = await cur.fetchone()
        mode = "stamp"
        if turn is not None and turn[0]:  # our turn, and something committed to number
            cur = await conn.execute(self._sql["commit_order_read"])
            found = await cur.fetchone()
            mode = found[0] if found is not None else "stamp"
            ingest = self._sql["ingest_by_id" if mode == "id" else "ingest"]
            cur = await conn.execute(ingest, {"transactions": INGEST_TRANSACTIONS})
            row = await cur.fetchone()
        else:
            row = (0, 0, 0, 0, None)
        await conn.execute(self._sql["ingest_plans_reset"])
        assert row is not None  # a SELECT of scalar subqueries always returns one row
        planned, numbered, transactions, _aggregates, late = row
        if numbered != planned:
            raise IngestRaced(f"ingest: {planned - numbered} of {planned} rows changed while being numbered")
        if late and mode == "id":
            log.warning(
                "%s runs with --commit-order id, but rows of %s became visible after a later id of their aggregate"
                " was numbered (aggregate: first new id < largest numbered id): a producer inserted before"
                " locking the aggregate, or without locking it, so these were numbered by id, not commit order;"
                " fix the producer or `relay settings set --commit-order stamp`",
                self.names.qualified,
                "; ".join(late),
            )
        return numbered, transactions >= INGEST_TRANSACTIONS

    async def finalize(self, decisions: Sequence[Decision]) -> set[int]:
        """Write every decision in one fenced statement; return the ids that were refused.

        A refused id means the row is no longer ``processing`` at our ``lease_version``:
        our lease expired and another worker claimed it (or the reaper sent it to dead).
        The row is left exactly as the new owner has it.
        """
        if not decisions:
            return set()
        # One statement in autocommit, atomic on its own: no BEGIN and COMMIT round trips.
        async with self.pool.connection() as conn:
            # An error that the database's encoding cannot hold (a LATIN1 table and a "…")
            # must not fail the write of a whole batch's outcomes.
            encoding = server_encoding(conn)
            # The numbers and statuses go as array literals: psycopg's list dumper costs about
            # a microsecond per element and array (a third of the loop's own CPU once), and
            # these hold nothing but digits and the three status words.
            errors = [None if d.error is None else storable(mask(d.error), encoding) for d in decisions]
            params = {
                "ids": _array_literal([d.message.id for d in decisions]),
                "versions": _array_literal([d.message.lease_version for d in decisions]),
                "statuses": _array_literal([d.status for d in decisions]),
                "delays": _array_literal([repr(float(d.delay_s)) for d in decisions]),
                # The one place last_error is written: masked here whoever built the decision
                # (relay.decide masks its texts before cutting them, too). None when no
                # decision has one: unnest gives each row a NULL.
                "errors": errors if any(e is not None for e in errors) else None,
                "refunds": _array_literal([1 if d.refund else 0 for d in decisions]),
            }
            # Not prepared: a generic plan cannot see how many ids the arrays hold and
            # may join them to the table by a scan; a fresh plan per batch is cheaper.
            cur = await conn.execute(self._sql["finalize"], params, prepare=False)
            written = {outbox_id for (outbox_id,) in await cur.fetchall()}
        return {d.message.id for d in decisions} - written

    async def record_payloads(self, refs: Sequence[str], ids: Sequence[int]) -> None:
        """Name the objects about to be stored for the rows ``ids`` (relay.claimcheck), before
        they are written: relay prune deletes each once its row has left history."""
        async with self.pool.connection() as conn:
            await conn.execute(self._sql["payloads_record"], {"refs": list(refs), "ids": list(ids)})

    # ---- this process's row in <table>_listeners (relay.wakeup.Presence writes it)

    async def set_listener(self, owner: str, *, idle: bool, ttl: timedelta) -> None:
        """Say that the relay process ``owner`` is idle (wake it) or working (do not), for ``ttl``."""
        await self._listeners("listener_set", {"owner": owner, "idle": idle, "ttl": ttl})

    async def drop_listener(self, owner: str) -> None:
        await self._listeners("listener_drop", {"owner": owner})

    async def sweep_listeners(self) -> None:
        """Delete the rows of relay processes that died without removing theirs."""
        await self._listeners("listener_sweep", {})

    async def _listeners(self, change: str, params: dict[str, Any]) -> None:
        """One change to <table>_listeners, and the producers' answer recomputed from the
        rows, in one transaction under the settings row's lock (see listener_turn)."""
        async with self.pool.connection() as conn, conn.transaction():
            await conn.execute(self._sql["listener_turn"])
            await conn.execute(self._sql[change], params)
            await conn.execute(self._sql["listener_answer"])


# A claim without housekeeping is one statement, atomic on its own (autocommit).
_NO_TRANSACTION = contextlib.nullcontext()

# Columns of the claim's RETURNING list that the claim
# reads before a row becomes a message (message_from_row names them all). The rows stay psycopg's
# plain tuples: a claim handles one per leased row, and a named row type would cost a
# Python call per row on the hot path.
_ID, _PAYLOAD, _LEASE_VERSION, _BYTES = 0, 4, 6, 10


class _PayloadLoader(Loader):
    """jsonb as the bytes PostgreSQL sent, its JSON text: publishers pass it on as the body,
    so it is neither parsed nor decoded (each would copy a large payload once more)."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


async def _connect_like(pool: AsyncConnectionPool[Any], limits: SessionLimits | None) -> psycopg.AsyncConnection[Any]:
    """A new connection outside ``pool``, made and set up as the pool's own (one at a time
    per process: oversized messages take turns, relay.oversize)."""
    conninfo: Any = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
    kwargs: Any = pool.kwargs() if callable(pool.kwargs) else pool.kwargs
    if inspect.isawaitable(conninfo):
        conninfo = await conninfo
    if inspect.isawaitable(kwargs):
        kwargs = await kwargs
    conn = await psycopg.AsyncConnection.connect(conninfo, **(kwargs or {}))
    try:
        await configure_session(conn, limits)
    except BaseException:
        await conn.close()
        raise
    return conn


def _array_literal(values: Sequence[object]) -> str:
    """A PostgreSQL array literal of ``values``: numbers or plain words only, which need no
    quoting (what finalize sends; text from anywhere else goes through psycopg)."""
    return "{" + ",".join(map(str, values)) + "}"


async def spool_payload(
    conn: psycopg.AsyncConnection[Any], statements: Mapping[str, Any], copy: str, params: Mapping[str, Any]
) -> SpooledPayload | None:
    """One row's payload read a slice at a time into an anonymous temporary file, hashed on
    the way (sql/queries.sql, payload_spool_table): the statement ``copy`` of ``statements``
    copies it into the session's temporary table; None when it copied no row. ``conn`` in
    autocommit mode; the table lives for one transaction of it."""
    handle = tempfile.TemporaryFile(prefix="relay-payload-")  # noqa: SIM115 (handed on open)
    try:
        async with conn.transaction():
            await conn.execute(statements["payload_spool_table"])
            await conn.execute(statements["payload_spool_external"])
            cur = await conn.execute(statements[copy], params)
            if cur.rowcount != 1:
                handle.close()
                return None
            sha, size = hashlib.sha256(), 0
            reader = conn.cursor(binary=True)
            while True:
                await reader.execute(statements["payload_spool_slice"], {"at": size + 1, "n": SPOOL_SLICE})
                found = await reader.fetchone()
                chunk = bytes(found[0]) if found is not None and found[0] is not None else b""
                sha.update(chunk)
                handle.write(chunk)
                size += len(chunk)
                if len(chunk) < SPOOL_SLICE:
                    break
    except BaseException:
        handle.close()
        raise
    handle.seek(0)
    return SpooledPayload(handle, size, sha.digest())


def payload_cursor(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[Any]:
    """A cursor that returns jsonb payloads as the bytes PostgreSQL sent."""
    cur = conn.cursor()
    cur.adapters.register_loader("jsonb", _PayloadLoader)
    return cur


_TEXT_COLUMNS = ("aggregate_type", "aggregate_id", "event_type")


def message_from_row(row: Sequence[Any], body: bytes, *, exact: bool = False) -> OutboxMessage | Unreadable:
    """A claimed row (the claims' RETURNING list, in its order) as the message a publisher
    gets, or as an Unreadable one (dead alone, saying why): its producer headers are
    refused, or, on a SQL_ASCII database (``exact``), its text or its payload holds bytes
    that are not UTF-8. ``body`` is its payload (read afterwards when the row was over the
    byte budget).

    Whatever a producer wrote, this returns: an error no rule foresaw while reading one
    row is that row's outcome, never an exception that stops the worker and, through the
    rows it leaves leased, every relay that claims them after it."""
    try:
        return _message_from_row(row, body, exact=exact)
    except Exception as exc:
        bare = OutboxMessage(
            id=row[_ID],
            aggregate_type=readable(row[1]) if isinstance(row[1], str) else "?",
            aggregate_id=readable(row[2]) if isinstance(row[2], str) else "?",
            event_type=readable(row[3]) if isinstance(row[3], str) else "?",
            body=b"",
            attempt=row[5],
            lease_version=row[_LEASE_VERSION],
            ordered=bool(row[8]),
        )
        return Unreadable(bare, f"the row cannot be read: {type(exc).__name__}: {first_line(exc)}")


def _message_from_row(row: Sequence[Any], body: bytes, *, exact: bool) -> OutboxMessage | Unreadable:
    (outbox_id, aggregate_type, aggregate_id, event_type, _payload, attempts, lease_version, age_s, ordered,
     aggregate_seq, _bytes, raw_headers, event_id, aggregate_epoch, created_at) = row  # fmt: skip
    texts = (aggregate_type, aggregate_id, event_type)
    problem = None
    if exact:
        columns = zip(_TEXT_COLUMNS, texts, strict=True)
        problem = next(((column, where) for column, value in columns if (where := not_utf8(value))), None)
        if problem is None and (where := not_utf8_bytes(body)):
            problem = ("payload", where)
    if problem is not None:
        texts = (readable(texts[0]), readable(texts[1]), readable(texts[2]))
    headers, refused = None, None
    try:
        # jsonb comes as its JSON text here, as the payload does (_PayloadLoader).
        headers = decode_headers(raw_headers)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError (SQL_ASCII) included
        refused = str(exc)
    message = OutboxMessage(
        id=outbox_id,
        aggregate_type=texts[0],
        aggregate_id=texts[1],
        event_type=texts[2],
        body=body,
        attempt=attempts,
        lease_version=lease_version,
        age_s=age_s,
        ordered=ordered,
        aggregate_seq=aggregate_seq,
        headers=headers,
        event_id=None if event_id is None else str(event_id),
        aggregate_epoch=aggregate_epoch,
        created_at=created_at,
    )
    if problem is None and refused is None:
        return message
    if problem is None:
        return Unreadable(message, f"the producer's headers are refused: {refused}")
    column, where = problem
    return Unreadable(
        message,
        f"{column} is not valid UTF-8 ({where}); the database's encoding is {SQL_ASCII}, which stores"
        " text unchecked, and the relay publishes UTF-8 only: correct the row, then `relay dead retry` it",
    )
