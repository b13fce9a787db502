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
import hashlib
import logging
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from relay.errors import ConfigError, first_line
from relay.message import log_fields
from relay.ops import queries
from relay.ops.queries import Conn, DeadFilter, DeadMessage, DeadPage, LockedRow, Touched
from relay.sqlnames import OutboxNames

log = logging.getLogger("relay.dead")

Action = Literal["retry", "skip"]
# What group_key() returns: `relay dead ... --group KEY` and the console check a key with it.
GROUP_KEY = re.compile(r"[0-9a-f]{8}")


@dataclass(frozen=True)
class DeadGroup:
    """Dead messages whose errors differ only in numbers, ids and quoted values."""

    key: str  # stable short hash of the fingerprint: `relay dead retry --group KEY`
    fingerprint: str
    count: int
    blocking: int  # how many of them hold up an ordered aggregate
    event_types: tuple[str, ...]
    first_id: int
    last_id: int
    sample_error: str | None
    ids: tuple[int, ...] = field(repr=False)


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


# Error-text normalisation for grouping: the parts of a message that vary per message
# (quoted values, ids, numbers) are replaced, so "order 41 is too large (262211 bytes)" and
# "order 42 is too large (300002 bytes)" fall into one group. Applied in this order:
# quoted text first (it may contain anything), then id shapes, then bare numbers.
_NORMALISE: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"'(?:[^'\\]|\\.)*'"), "'?'"),
    (re.compile(r'"(?:[^"\\]|\\.)*"'), '"?"'),
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I), "<uuid>"),
    (re.compile(r"\b0x[0-9a-f]+\b", re.I), "<hex>"),
    # Long hex runs (request ids, digests) that contain at least one digit: "deadbeef" the
    # word stays, "9f86d081884c7d65" goes.
    (re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{8,}\b", re.I), "<hex>"),
    (re.compile(r"\d+(?:\.\d+)?"), "<n>"),
    (re.compile(r"\s+"), " "),
)
FINGERPRINT_MAX = 160  # characters: enough to tell errors apart, short enough for one line


def fingerprint(error: str | None) -> str:
    """``error`` with its varying parts replaced (first line only), for grouping."""
    if not error or not error.strip():
        return "(no error recorded)"
    text = first_line(error)
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return text.strip()[:FINGERPRINT_MAX]


def group_key(error: str | None) -> str:
    """The stable 8-hex-digit key of ``error``'s fingerprint."""
    return hashlib.sha256(fingerprint(error).encode()).hexdigest()[:8]


def default_operator() -> str:
    """``user@host`` of whoever runs the command, recorded with every re-drive and skip."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no LOGNAME/USER (some containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def list_dead(conn: Conn, names: OutboxNames, flt: DeadFilter, *, limit: int | None = None) -> DeadPage:
    """Dead messages matching ``flt`` in id order, at most ``limit`` of them (None: all)."""
    return await queries.dead_list(conn, names, flt, limit)


async def group_dead(conn: Conn, names: OutboxNames, flt: DeadFilter) -> tuple[DeadGroup, ...]:
    """Dead messages matching ``flt`` grouped by error fingerprint, largest group first."""
    page = await list_dead(conn, names, flt)
    return group_messages(page.messages)


def group_messages(messages: Sequence[DeadMessage]) -> tuple[DeadGroup, ...]:
    """Group ``messages`` by :func:`group_key` of their last error."""
    buckets: dict[str, list[DeadMessage]] = {}
    for m in messages:
        buckets.setdefault(group_key(m.last_error), []).append(m)
    groups = [
        DeadGroup(
            key=key,
            fingerprint=fingerprint(ms[0].last_error),
            count=len(ms),
            blocking=sum(m.blocking for m in ms),
            event_types=tuple(sorted({m.event_type for m in ms})),
            first_id=ms[0].id,
            last_id=ms[-1].id,
            sample_error=ms[-1].last_error,
            ids=tuple(m.id for m in ms),
        )
        for key, ms in buckets.items()
    ]
    return tuple(sorted(groups, key=lambda g: (-g.count, g.first_id)))


async def select_ids(conn: Conn, names: OutboxNames, flt: DeadFilter, group: str | None = None) -> list[int]:
    """Ids of the dead messages matching ``flt`` (and in ``group``, when given), in id order.

    An empty match is a ConfigError naming the filter, so a write never silently does nothing.
    """
    page = await list_dead(conn, names, flt)
    ids = [m.id for m in page.messages if group is None or group_key(m.last_error) == group]
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
        found = {r.id: r for r in await queries.dead_lock(conn, names, wanted)}
        refused = tuple(r for r in (_refusal(i, found.get(i), expected) for i in wanted) if r is not None)
        candidates = tuple(_touched(found[i]) for i in wanted if i in found and found[i].status == "dead")
        if refused or dry_run:
            # Nothing to write; the transaction ends holding only the row locks it took.
            return WriteResult(action, dry_run, candidates, refused, by, note)
        write = queries.dead_retry if action == "retry" else queries.dead_skip
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
