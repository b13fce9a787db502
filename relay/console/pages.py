"""What each console page shows, read through relay.ops: the same figures, verdicts and
rules as `relay status`, `relay explain` and `relay dead`, as plain objects for the
templates. Nothing here renders HTML, and nothing here writes but :func:`act`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

from relay.db import readmodel
from relay.db.names import OutboxNames
from relay.db.readmodel import AggregateMessage, BlockedHead, Conn, DeadFilter, DeadMessage, MessageDetail
from relay.errors import ConfigError
from relay.ids import parse_lease_version, parse_outbox_id
from relay.ops.deadletters import (
    GROUP_KEY,
    Action,
    DeadGroup,
    DeadGroups,
    WriteResult,
    group_dead,
    group_of,
    one_group,
    retry,
    select_ids,
    skip,
)
from relay.ops.explain import Explanation, explain
from relay.ops.status import Status, attempt_histogram, by_event_type_status, read_status

# How many rows a page lists; more are counted and linked to a narrower filter.
PAGE_ROWS = 200
# The aggregate page looks for finished messages among the newest this many ids: no index
# covers the done history by aggregate (sql/ops.sql, console_aggregate_messages).
RECENT_IDS = 100_000
AGGREGATE_ROWS = 100
FILTER_MAX = 500  # characters of one filter field
# The most dead messages one action (a preview and its confirm) takes. The confirm form
# carries every id and lease_version back (at most 40 bytes a pair: 400 kB, inside
# aiohttp's 1 MiB request body limit) and the preview lists them all; a larger selection
# is for `relay dead retry|skip` on the command line, or a narrower filter.
ACTION_MAX = 10_000


# Event types the overview lists (the most unfinished rows first); the rest are counted.
# With 100,000 event types the page was 11.8 MB, fetched again by every tab every 2 s.
EVENT_TYPES_SHOWN = 50


@dataclass(frozen=True)
class Overview:
    status: Status
    attempts: list[tuple[str, int]]
    event_types: int  # event types with unfinished rows, of which status.by_event_type lists the top


async def overview(conn: Conn, names: OutboxNames) -> Overview:
    status = await read_status(conn, names)
    rows, count = await readmodel.event_types_top(conn, names, EVENT_TYPES_SHOWN)
    status = replace(status, by_event_type=by_event_type_status(status.summary.at, rows))
    return Overview(status, attempt_histogram(status.attempts), count)


def dead_filter(query: Mapping[str, str]) -> DeadFilter:
    """The dead-message filter of a page's query string (``event_type``, ``aggregate``,
    ``error``: a substring), as `relay dead list` takes them; ConfigError names a field
    that cannot be used."""
    for key in ("event_type", "aggregate", "error"):
        _check_text(query.get(key, ""), key)
    event_type = query.get("event_type", "")
    return DeadFilter(
        event_types=(event_type,) if event_type else (),
        aggregate_id=query.get("aggregate") or None,
        error=query.get("error") or None,
    )


def _check_text(value: str, key: str) -> None:
    """A form or query field the database will be given: at most FILTER_MAX characters, no NUL."""
    if len(value) > FILTER_MAX:
        raise ConfigError(f"invalid {key}: longer than {FILTER_MAX} characters")
    if "\x00" in value:
        raise ConfigError(f"invalid {key}: it contains a NUL character")


def page_number(query: Mapping[str, str]) -> int:
    """``?page=N`` (1 when absent); ConfigError for anything but a page number."""
    raw = query.get("page", "1")
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw[:8]) <= 1_000_000 or len(raw) > 7:
        raise ConfigError("invalid page: give ?page=N, a number from 1")
    return int(raw)


def after_id(query: Mapping[str, str]) -> int:
    """``?after=ID`` (0 when absent): a group's page starts after that id."""
    raw = query.get("after", "0")
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise ConfigError("invalid after: give ?after=ID, a message id")
    return int(raw)


async def dead_groups(conn: Conn, names: OutboxNames, flt: DeadFilter, page: int = 1) -> DeadGroups:
    """One page of groups, counted in SQL (sql/ops.sql, dead_groups)."""
    return await group_dead(conn, names, flt, page=page)


@dataclass(frozen=True)
class GroupPage:
    key: str
    group: DeadGroup | None  # None: no dead message (matching the filter) is in it any more
    messages: tuple[DeadMessage, ...]  # PAGE_ROWS of it, after ``after``
    after: int
    next_after: int | None  # the next page starts after this id; None: this is the last


async def dead_group(conn: Conn, names: OutboxNames, key: str, flt: DeadFilter, after: int = 0) -> GroupPage:
    group = await one_group(conn, names, key, flt)
    if group is None:
        return GroupPage(key, None, (), after, None)
    rows = await readmodel.dead_group_page(conn, names, flt, group=group_of(key), after=after, limit=PAGE_ROWS + 1)
    more = len(rows) > PAGE_ROWS
    rows = rows[:PAGE_ROWS]
    return GroupPage(key, group, rows, after, rows[-1].id if more and rows else None)


@dataclass(frozen=True)
class MessagePage:
    message: MessageDetail
    payload: str  # pretty-printed when it is JSON (it always is: the column is jsonb)
    headers: Mapping[str, str] | None
    ahead: int | None  # ordered messages of its aggregate before it (0: it is the head)
    explanation: Explanation | None  # its aggregate's, for ordered messages


async def message(conn: Conn, names: OutboxNames, outbox_id: int) -> MessagePage | None:
    m = await readmodel.message_detail(conn, names, outbox_id)
    if m is None:
        return None
    payload = m.payload
    if m.payload_length <= len(m.payload):  # whole: shown indented; a part is shown as it is
        # Nested deeper than Python's decoder goes (jsonb takes some 20,000 levels): as stored.
        with contextlib.suppress(ValueError, RecursionError):
            payload = json.dumps(json.loads(m.payload), indent=2, ensure_ascii=False)
    ahead = None
    if m.ordered and m.aggregate_seq is not None and m.head_seq is not None and m.status != "done":
        ahead = max(m.aggregate_seq - m.head_seq, 0)
    explanation = await _explanation(conn, names, m.aggregate_id) if m.ordered else None
    return MessagePage(m, payload, shown_headers(m.headers), ahead, explanation)


def shown_headers(text: str | None) -> dict[str, str] | None:
    """A message's headers column (its first 64 KiB) as the page lists it: name and value,
    a value that is not a string as its JSON text. Whatever a producer wrote there (the
    relay refuses all but an object of strings, yet the row keeps it), the page shows
    it: cut, not an object, or nested too deep to decode, it is one row of raw text."""
    if not text:
        return None
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError
        return {str(k): v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in value.items()}
    except (ValueError, RecursionError):
        return {"(headers as stored, first 64 KiB)": text}


@dataclass(frozen=True)
class Blocked:
    head: BlockedHead
    explanation: Explanation


async def blocked(conn: Conn, names: OutboxNames) -> list[Blocked]:
    """Aggregates whose head is dead, oldest first, each with `relay explain`'s verdict."""
    return [
        Blocked(head, await explain(conn, names, head.aggregate_id))
        for head in await readmodel.blocked_heads(conn, names, PAGE_ROWS)
    ]


@dataclass(frozen=True)
class AggregatePage:
    aggregate_id: str
    explanation: Explanation | None  # None: nothing unfinished and no ordered history
    messages: list[AggregateMessage]
    recent_ids: int = RECENT_IDS


async def _explanation(conn: Conn, names: OutboxNames, aggregate_id: str) -> Explanation | None:
    """`relay explain`'s verdict, or None for an aggregate with nothing unfinished and no
    ordered history (which explain refuses as not found)."""
    try:
        return await explain(conn, names, aggregate_id)
    except ConfigError:
        return None


async def aggregate(conn: Conn, names: OutboxNames, aggregate_id: str) -> AggregatePage:
    explanation = await _explanation(conn, names, aggregate_id)
    rows = await readmodel.aggregate_messages(conn, names, aggregate_id, recent=RECENT_IDS, limit=AGGREGATE_ROWS)
    return AggregatePage(aggregate_id, explanation, rows)


# ---- actions


@dataclass(frozen=True)
class ActionRequest:
    """A re-drive or skip as a form asks for it: explicit ids, or a group (with the page's
    filter) resolved to ids at preview time, so the confirm step writes exactly the rows
    the operator saw."""

    action: Action
    ids: tuple[int, ...]
    group: str | None
    flt: DeadFilter
    reason: str
    # The lease_version of each of ``ids`` as the preview showed it (the confirm form sends
    # them back): the write refuses a row that has changed since. None: as the rows are now
    # (a script's direct request, as `relay dead` takes it).
    versions: Mapping[int, int] | None = None


def action_request(form: Mapping[str, str]) -> ActionRequest:
    action = form.get("action", "")
    if action not in ("retry", "skip"):
        raise ConfigError("invalid action: expected retry or skip")
    raw_ids = form.get("ids", "").replace(",", " ").split()
    _check_size(len(raw_ids))
    ids = tuple(parse_outbox_id(i) for i in raw_ids)
    group = form.get("group") or None
    if group is not None and not GROUP_KEY.fullmatch(group):
        raise ConfigError("invalid group: expected the 16-hex-digit key `relay dead list --group` shows")
    if not raw_ids and group is None:
        raise ConfigError(f"nothing to {action}: give dead message ids or a group")
    reason = form.get("reason", "").strip()
    _check_text(reason, "reason")
    versions = _versions(ids, form.get("versions"))
    return ActionRequest(action, ids, group, dead_filter(form), reason, versions)  # type: ignore[arg-type]


def _versions(ids: tuple[int, ...], given: str | None) -> dict[int, int] | None:
    if given is None:
        return None
    raw = given.split()
    if len(raw) != len(ids):
        raise ConfigError("invalid versions: one lease_version per id, in the ids' order (preview again)")
    return dict(zip(ids, map(parse_lease_version, raw), strict=True))


def _check_size(count: int) -> None:
    if count > ACTION_MAX:
        raise ConfigError(
            f"too many messages for one action from the console: {count:,}, at most {ACTION_MAX:,};"
            " narrow the filter, or use `relay dead retry|skip` on the command line"
        )


async def resolve_ids(conn: Conn, names: OutboxNames, req: ActionRequest) -> list[int]:
    """The ids ``req`` names: its own, or its group's (matching its filter) now; at most
    :data:`ACTION_MAX` of them, else ConfigError."""
    ids = list(req.ids) if req.ids else await select_ids(conn, names, req.flt, req.group)
    _check_size(len(ids))
    return ids


async def act(
    conn: Conn, names: OutboxNames, req: ActionRequest, ids: list[int], *, by: str, dry_run: bool
) -> WriteResult:
    """`relay dead retry|skip` on ``ids``, with its rules (all or nothing, ordered re-drive in
    id order, a reason for a skip), recorded as done ``by``; fenced by ``req.versions``
    when the request carries them."""
    if req.action == "retry":
        return await retry(
            conn, names, ids, by=by, note=req.reason or None, dry_run=dry_run, expected_versions=req.versions
        )
    return await skip(conn, names, ids, by=by, reason=req.reason, dry_run=dry_run, expected_versions=req.versions)


# A payload is streamed in parts of this many bytes: the console never holds more.
PAYLOAD_PART = 1 << 20


def payload_parts(conn: Conn, names: OutboxNames, outbox_id: int) -> AsyncIterator[bytes]:
    """The whole payload of ``outbox_id`` as JSON text (UTF-8), in parts (none: no such message)."""
    return readmodel.payload_parts(conn, names, outbox_id, PAYLOAD_PART)
