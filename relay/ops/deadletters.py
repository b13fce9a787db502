"""`relay dead`: list dead messages, group them by error, re-drive them or skip them.

A dead message at the head of an ordered aggregate stops that aggregate, so both writes
are built around order:

* **retry** puts the rows back to ``pending`` with their attempts reset and available now
  (one timestamp for all, so the claims take them in id order); the heads trigger makes a
  re-driven head claimable at once, and its aggregate resumes in order behind it.
* **skip** marks the rows ``done`` without delivery, recording who and why; the heads
  trigger hands the aggregate on to its next message.

Both lock the rows in id order and check every one before changing any: an unknown id or
one that is not dead refuses the whole request and nothing changes. The update itself is
fenced by ``status = 'dead'`` as well, like the relay's finalize.
"""

from __future__ import annotations

import getpass
import logging
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from relay.db import actions, readmodel
from relay.db.actions import LockedRow, Touched
from relay.db.names import OutboxNames
from relay.db.readmodel import DeadFilter, DeadPage
from relay.db.rows import Conn
from relay.errors import ConfigError
from relay.message import log_fields

log = logging.getLogger("relay.dead")

Action = Literal["retry", "skip"]
# A group's key as `relay dead ... --group KEY` and the console take it: the 64-bit
# dead_group (migration 0014) as 16 hex digits.
GROUP_KEY = re.compile(r"[0-9a-f]{16}")
# Groups per page of `relay dead list --group` and the console's /dead.
GROUPS_PER_PAGE = 50


def key_of(group: int) -> str:
    """The 16-hex-digit key of a dead_group value (a signed 64-bit integer)."""
    return f"{group & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def group_of(key: str) -> int:
    """The dead_group value of a key; ConfigError for anything that is not one."""
    if not GROUP_KEY.fullmatch(key):
        raise ConfigError(f"invalid group {key[:40]!r}: a group is 16 hex digits, as relay dead list --group shows")
    n = int(key, 16)
    return n - (1 << 64) if n >= 1 << 63 else n


@dataclass(frozen=True)
class DeadGroup:
    """Dead messages whose errors differ only in numbers, ids and quoted values (the SQL
    function <table>_fingerprint, migration 0014)."""

    key: str  # `relay dead retry --group KEY`
    fingerprint: str
    count: int
    blocking: int  # how many of them hold up an ordered aggregate
    event_types: tuple[str, ...]  # among its first 100 messages
    first_id: int
    last_id: int
    sample_error: str | None  # the last message's error, its first 2,000 characters
    sample_length: int  # that error's whole length


@dataclass(frozen=True)
class DeadGroups:
    """One page of groups, largest first, and how many there are in all."""

    groups: tuple[DeadGroup, ...]
    total_groups: int
    total: int  # dead messages in all the groups
    page: int  # 1-based
    per_page: int

    @property
    def pages(self) -> int:
        return max(1, -(-self.total_groups // self.per_page))


def _group(r: readmodel.GroupRow) -> DeadGroup:
    return DeadGroup(
        key=key_of(r.group),
        fingerprint=r.fingerprint,
        count=r.count,
        blocking=r.blocking,
        event_types=r.event_types,
        first_id=r.first_id,
        last_id=r.last_id,
        sample_error=r.sample_error,
        sample_length=r.sample_length,
    )


@dataclass(frozen=True)
class Refusal:
    """An id a re-drive or skip would not touch, and why."""

    id: int
    reason: str  # "unknown id" or "not dead (status done)"


@dataclass(frozen=True)
class WriteResult:
    """What a re-drive or skip did. When anything was refused, nothing changed."""

    action: Action
    dry_run: bool
    changed: tuple[Touched, ...]  # in a dry run or a refusal: what would have changed
    refused: tuple[Refusal, ...]
    by: str
    note: str | None

    @property
    def applied(self) -> bool:
        return not self.dry_run and not self.refused


def default_operator() -> str:
    """``user@host`` of whoever runs the command, recorded with every re-drive and skip."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def list_dead(conn: Conn, names: OutboxNames, flt: DeadFilter, *, limit: int | None = None) -> DeadPage:
    """Dead messages matching ``flt`` in id order, at most ``limit`` of them (None: all)."""
    return await readmodel.dead_list(conn, names, flt, limit)


async def group_dead(
    conn: Conn, names: OutboxNames, flt: DeadFilter, *, page: int = 1, per_page: int = GROUPS_PER_PAGE
) -> DeadGroups:
    """One page of the dead messages matching ``flt`` grouped by error, largest group
    first: grouped and counted in SQL, whatever their number."""
    found = await readmodel.dead_groups(
        conn, names, flt, group=None, limit=per_page, offset=(max(page, 1) - 1) * per_page
    )
    return DeadGroups(tuple(_group(g) for g in found.groups), found.total_groups, found.total, max(page, 1), per_page)


async def one_group(conn: Conn, names: OutboxNames, key: str, flt: DeadFilter) -> DeadGroup | None:
    """The group ``key`` of the dead messages matching ``flt``; None when none is in it."""
    found = await readmodel.dead_groups(conn, names, flt, group=group_of(key), limit=1, offset=0)
    return _group(found.groups[0]) if found.groups else None


async def select_ids(conn: Conn, names: OutboxNames, flt: DeadFilter, group: str | None = None) -> list[int]:
    """Ids of the dead messages matching ``flt`` (and in ``group``, when given), in id order.

    An empty match is a ConfigError naming the filter, so a write never silently does nothing.
    """
    ids = await readmodel.dead_ids(conn, names, flt, group=None if group is None else group_of(group), limit=None)
    if not ids:
        what = flt.describe()
        if group is not None:
            what = f"group {group}" + ("" if flt.is_empty() else f", {what}")
        raise ConfigError(f"no dead messages match {what} in {names.qualified}; nothing changed")
    return ids


async def retry(
    conn: Conn,
    names: OutboxNames,
    ids: Sequence[int],
    *,
    by: str,
    note: str | None = None,
    dry_run: bool = False,
    expected_versions: Mapping[int, int] | None = None,
) -> WriteResult:
    """Re-drive the dead messages ``ids``: pending, attempts 0, available now, in id order.

    With ``expected_versions`` (id -> lease_version, as a preview saw them), a row claimed
    since (re-driven by someone else and dead again, say) refuses the whole request."""
    return await _write(conn, names, "retry", ids, by=by, note=note, dry_run=dry_run, expected=expected_versions)


async def skip(
    conn: Conn,
    names: OutboxNames,
    ids: Sequence[int],
    *,
    by: str,
    reason: str,
    dry_run: bool = False,
    expected_versions: Mapping[int, int] | None = None,
) -> WriteResult:
    """Mark the dead messages ``ids`` done without delivery, recording ``by`` and ``reason``
    (``expected_versions`` as for :func:`retry`)."""
    if not reason.strip():
        raise ConfigError("a skip needs a reason: pass --reason TEXT (it is recorded with the message)")
    return await _write(conn, names, "skip", ids, by=by, note=reason, dry_run=dry_run, expected=expected_versions)


async def _write(
    conn: Conn,
    names: OutboxNames,
    action: Action,
    ids: Sequence[int],
    *,
    by: str,
    note: str | None,
    dry_run: bool,
    expected: Mapping[int, int] | None = None,
) -> WriteResult:
    wanted = sorted(set(ids))
    if not wanted:
        raise ConfigError(f"nothing to {action}: give dead message ids, a filter or a group")
    async with conn.transaction():
        found = {r.id: r for r in await actions.dead_lock(conn, names, wanted)}
        refused = tuple(r for r in (_refusal(i, found.get(i), expected) for i in wanted) if r is not None)
        candidates = tuple(_touched(found[i]) for i in wanted if i in found and found[i].status == "dead")
        if refused or dry_run:
            # Nothing to write; the transaction ends holding only the row locks it took.
            return WriteResult(action, dry_run, candidates, refused, by, note)
        write = actions.dead_retry if action == "retry" else actions.dead_skip
        changed = tuple(sorted(await write(conn, names, wanted, by=by, note=note), key=lambda t: t.id))
    verb = "re-driven to pending" if action == "retry" else "skipped (done without delivery)"
    for t in changed:
        log.info(
            "dead message %s by %s", verb, by, extra=log_fields(t.id, t.aggregate_id, t.event_type, t.lease_version)
        )
    return WriteResult(action, dry_run, changed, (), by, note)


def _refusal(oid: int, row: LockedRow | None, expected: Mapping[int, int] | None) -> Refusal | None:
    """Why ``row`` (locked) may not be written, or None."""
    if row is None:
        return Refusal(oid, "unknown id")
    if row.status != "dead":
        return Refusal(oid, f"not dead (status {row.status})")
    if expected is not None and expected.get(oid) != row.lease_version:
        # The fencing token moved: the row was claimed since the preview, so the error and
        # attempts the operator decided on are not the ones it holds now.
        return Refusal(oid, "changed since the preview (claimed again); preview again")
    return None


def _touched(r: LockedRow) -> Touched:
    return Touched(r.id, r.aggregate_id, r.event_type, r.lease_version, r.ordered)
