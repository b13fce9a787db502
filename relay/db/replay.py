"""The plan a replay takes of the outbox's history, and the pages it reads of it (the
decisions, pacing and publishing are relay.replay's)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

import psycopg

from relay.db.dispatch import Spools, Unreadable, message_from_row, payload_cursor, spool_payload
from relay.db.names import OutboxNames
from relay.db.statements import named_queries, statement
from relay.db.text import SQL_ASCII, server_encoding
from relay.message import OutboxMessage

# No payload is larger: spool_over when the claim-check is off.
NEVER_SPOOLED = 2**62


class Selection(Protocol):
    """What a plan is taken of (relay.replay.Selection): the plan statement's parameters,
    and the kinds of history (delivered, dead, skipped) its pages take."""

    @property
    def histories(self) -> list[str]: ...

    def params(self) -> dict[str, Any]: ...


# The plan's column count before the claims' RETURNING list in a replay_page row.
_PLAN_COLUMNS = 2


@dataclass(frozen=True)
class LeftOut:
    """Rows the selectors took that the plan leaves out, by why."""

    skipped: int = 0  # skipped by an operator (never delivered), without --include-skipped
    dead: int = 0  # dead (never delivered), without --include-dead
    excluded: int = 0  # named by --exclude

    @property
    def total(self) -> int:
        return self.skipped + self.dead + self.excluded


@dataclass(frozen=True)
class PlanSummary:
    """What a plan holds (the dry run's answer), and what the selection left out."""

    count: int
    first_id: int | None
    last_id: int | None
    aggregates: int
    first_created: datetime | None
    last_created: datetime | None
    payload_bytes: int
    left_out: LeftOut = LeftOut()


@dataclass(frozen=True, slots=True)
class PlanRow:
    rank: int
    resume_from: int
    message: OutboxMessage | Unreadable | None  # None: gone since the plan was taken


class ReplayPlan:
    """The plan of one replay, in its connection's session: taken once, then read a page
    at a time in short statements (no transaction stays open)."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        names: OutboxNames,
        *,
        spools: Spools | None = None,
        spool_over: int | None = None,
    ) -> None:
        """``spools`` (relay.claimcheck.ClaimChecks.stores): a payload the claim-check
        stores is read into a temporary file, not memory (relay.message.SpooledPayload);
        ``spool_over``, the smallest threshold, picks the ones the page leaves to it."""
        self.conn = conn
        self.spools = spools
        self.spool_over = spool_over
        # The spool's transaction and the publishing workers' records share the connection:
        # one at a time, so that no record commits or rolls back with a spool.
        self._turn = asyncio.Lock()
        self._sql = {
            name: statement(names, name) for name in named_queries() if name.startswith(("replay_", "payload_spool_"))
        }
        self._histories: list[str] = ["delivered"]
        self._record = statement(names, "payloads_record")

    async def record_payloads(self, refs: Sequence[str], ids: Sequence[int]) -> None:
        """Name the objects a replay is about to store (as OutboxStore.record_payloads)."""
        async with self._turn:
            await self.conn.execute(self._record, {"refs": list(refs), "ids": list(ids)})

    async def take(self, selection: Selection) -> PlanSummary:
        """Plan ``selection`` (replacing this session's last plan) and say what it holds."""
        self._histories = selection.histories
        await self.conn.execute(self._sql["replay_plan_table"])
        await self.conn.execute(self._sql["replay_plan_clear"])
        # Not prepared: each plan runs once, with selectors a generic plan would not see.
        # The plan scans the selected range of a table that may hold millions of rows, so
        # it runs without the session's statement timeout (set for the short statements
        # that follow): in a transaction of its own, where SET LOCAL ends with it.
        async with self.conn.transaction():
            await self.conn.execute(self._sql["replay_plan_untimed"])
            cur = await self.conn.execute(self._sql["replay_plan"], selection.params(), prepare=False)
            counts = await cur.fetchone()
        assert counts is not None  # an aggregate without GROUP BY returns one row
        cur = await self.conn.execute(self._sql["replay_summary"])
        row = await cur.fetchone()
        assert row is not None
        return replace(PlanSummary(*row), left_out=LeftOut(skipped=counts[1], dead=counts[2], excluded=counts[3]))

    async def page(self, after: int, count: int, budget: int) -> list[PlanRow]:
        """The plan's rows after rank ``after``: at most ``count``, and ``budget`` bytes of
        payload unless the first row alone is larger."""
        exact = server_encoding(self.conn) == SQL_ASCII
        params = {
            "after": after,
            "count": count,
            "budget": budget,
            "histories": self._histories,
            "spool_over": NEVER_SPOOLED if self.spool_over is None else self.spool_over,
        }
        async with payload_cursor(self.conn) as cur:
            await cur.execute(self._sql["replay_page"], params)
            rows = await cur.fetchall()
        found = []
        for row in rows:
            rank, resume_from, columns = row[0], row[1], row[_PLAN_COLUMNS:]
            if columns[0] is None:
                found.append(PlanRow(rank, resume_from, None))
            elif columns[4] is None:  # over the claim-check's threshold: read into a file
                async with self._turn:
                    spooled = await spool_payload(self.conn, self._sql, "replay_spool", {"id": columns[0]})
                if spooled is None:  # pruned since the page was read
                    found.append(PlanRow(rank, resume_from, None))
                    continue
                if self.spools is not None and self.spools(columns[3], spooled.size):
                    message = message_from_row(columns, b"", exact=exact)
                    if isinstance(message, OutboxMessage):
                        message = replace(message, spooled=spooled)
                else:  # over the smallest threshold, not its own route's: read it whole
                    with spooled.file:
                        message = message_from_row(columns, spooled.file.read(), exact=exact)
                found.append(PlanRow(rank, resume_from, message))
            else:
                found.append(PlanRow(rank, resume_from, message_from_row(columns, columns[4], exact=exact)))
        return found

    async def resume_from(self, rank: int) -> int | None:
        """Where a resumed replay starts once every rank below ``rank`` is confirmed; None
        past the end of the plan."""
        cur = await self.conn.execute(self._sql["replay_resume_from"], {"rank": rank})
        row = await cur.fetchone()
        return None if row is None else int(row[0])
