"""`relay release`: hand back the leases of a worker that is gone, before they expire.

A worker that dies holding a long lease leaves its rows ``processing`` until the lease
runs out; with ``--lease 1h`` its aggregates wait an hour. An operator who knows the host
is gone releases its rows at once, by owner or by id.

A release is what the reaper does to an expired lease, done early: the row goes back to
``pending`` (or to ``dead`` when its attempts are spent, so a message that kills every
worker still stops), the crashed claim keeps counting as an attempt, and the lease is
cleared. On top of that ``lease_version`` goes up by one, so the old owner's finalize,
should it come after all, matches nothing. The heads trigger makes a released ordered
head claimable again, and its aggregate resumes in order behind it.

Rows are locked in id order and released fenced by ``status = 'processing'`` and the
``lease_version`` read under that lock. Without ``--yes`` nothing is written: the command
shows what it would release. Rows it will not touch (unknown, not processing, held by
someone else) are reported with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.db import actions
from relay.db.actions import LeaseRow
from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.errors import ConfigError
from relay.ids import parse_id_list
from relay.message import log_fields
from relay.ops.deadletters import Refusal

log = logging.getLogger("relay.release")

MAX_IDS = 10_000  # one statement's worth; a crashed host holds workers x batch size rows
SHOWN = 50  # rows the text output lists; --json lists all


@dataclass(frozen=True)
class Held:
    """A leased row as `relay release` found it, and what releasing it makes of it."""

    id: int
    aggregate_id: str
    event_type: str
    lease_owner: str
    lease_version: int  # the version it is held at (the release writes version + 1)
    lease_until: datetime
    attempts: int
    ordered: bool
    aggregate_seq: int | None
    then: str  # 'pending', or 'dead' when its attempts are spent

    def log_fields(self) -> dict[str, Any]:
        return log_fields(self.id, self.aggregate_id, self.event_type, self.lease_version + 1)


@dataclass(frozen=True)
class ReleaseResult:
    """What a release did or, in a dry run, would do."""

    dry_run: bool
    at: datetime | None  # the database clock when the rows were read
    owner: str | None
    released: tuple[Held, ...]  # in a dry run: what would be released
    refused: tuple[Refusal, ...]  # reported, not touched
    by: str
    max_attempts: int


def parse_ids(values: Sequence[str]) -> list[int]:
    """``--ids 1,2,3`` (repeatable) as ids: ASCII digits only, each a positive bigint."""
    return parse_id_list(values, "--ids", MAX_IDS)


def _held(r: LeaseRow, max_attempts: int) -> Held:
    # Only rows found processing become Held, and the table's lease check gives those an
    # expiry; an owner is the relay's habit, not a constraint.
    assert r.lease_until is not None
    return Held(
        id=r.id,
        aggregate_id=r.aggregate_id,
        event_type=r.event_type,
        lease_owner=r.lease_owner or "?",
        lease_version=r.lease_version,
        lease_until=r.lease_until,
        attempts=r.attempts,
        ordered=r.ordered,
        aggregate_seq=r.aggregate_seq,
        then="dead" if r.attempts >= max_attempts else "pending",
    )


def _owned_by(lease_owner: str | None, owner: str) -> bool:
    return lease_owner is not None and (lease_owner == owner or lease_owner.startswith(owner + ":"))


async def release(
    conn: Conn,
    names: OutboxNames,
    *,
    owner: str | None = None,
    ids: Sequence[int] = (),
    by: str,
    note: str | None = None,
    max_attempts: int,
    dry_run: bool = True,
) -> ReleaseResult:
    """Release the processing rows held by ``owner`` (that lease owner, or every
    ``owner:...`` worker of it) and/or with ``ids``; with ``dry_run``, change nothing.

    A ConfigError when nothing at all can be released, naming why."""
    if owner is None and not ids:
        raise ConfigError("say whose leases to release: --owner OWNER or --ids 1,2,3")
    async with conn.transaction():
        rows = await actions.lease_rows(conn, names, ids=ids, owner=owner)
        at = rows[0].now if rows else None
        found = {r.id: r for r in rows}
        refused: list[Refusal] = []
        chosen: list[Held] = []
        for i in ids or sorted(found):
            r = found.get(i)
            if r is None:
                refused.append(Refusal(i, "unknown id"))
            elif r.status != "processing":
                refused.append(Refusal(i, f"not processing (status {r.status})"))
            elif owner is not None and not _owned_by(r.lease_owner, owner):
                refused.append(Refusal(i, f"held by {r.lease_owner}, not {owner}"))
            else:
                chosen.append(_held(r, max_attempts))
        if not chosen:
            holders = ", ".join(f"{h.lease_owner} ({h.n:,})" for h in await actions.lease_holders(conn, names))
            raise ConfigError(_nothing_line(names, owner, refused, holders))
        if dry_run:
            return ReleaseResult(True, at, owner, tuple(chosen), tuple(refused), by, max_attempts)
        written = await actions.release_leases(
            conn, names, [(h.id, h.lease_version) for h in chosen], max_attempts=max_attempts, by=by, note=note
        )
    # Under the row locks nothing can change between the read and the write; a row missing
    # here would mean the fence worked against us, and it is reported, not assumed.
    released = tuple(h for h in chosen if h.id in written)
    refused += [Refusal(h.id, "changed while being released; left as it is") for h in chosen if h.id not in written]
    for h in released:
        log.info(
            "lease released by %s (was held by %s), message back to %s",
            by,
            h.lease_owner,
            h.then,
            extra=h.log_fields(),
        )
    return ReleaseResult(False, at, owner, released, tuple(sorted(refused, key=lambda r: r.id)), by, max_attempts)


def _nothing_line(names: OutboxNames, owner: str | None, refused: Sequence[Refusal], holders: str) -> str:
    if refused:
        reasons = "; ".join(f"{r.id}: {r.reason}" for r in refused[:20])
        more = f" and {len(refused) - 20:,} more" if len(refused) > 20 else ""
        head = f"nothing to release in {names.qualified} (nothing changed): {reasons}{more}"
    else:
        head = f"no processing messages held by {owner!r} in {names.qualified}; nothing changed"
    return f"{head} (leases are held now by: {holders or 'nobody'})"
