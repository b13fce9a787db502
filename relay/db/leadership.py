"""Which relay of an outbox runs a duty only one should run (relay.services.Elected): the
holder of a session-level advisory lock, on a connection kept for that alone."""

from __future__ import annotations

from relay.db.names import OutboxNames
from relay.db.rows import Conn
from relay.db.session import TRANSIENT_DB_ERRORS
from relay.db.statements import statement


async def take(conn: Conn, names: OutboxNames, duty: str) -> bool:
    """Whether ``conn`` now leads ``duty`` for the outbox ``names`` (it keeps the lead until
    it closes). ``conn`` must be the lead's own connection, in autocommit."""
    cur = await conn.execute(statement(names, "leader_take"), {"duty": duty, "outbox": names.qualified})
    row = await cur.fetchone()
    return bool(row and row[0])


async def still_held(conn: Conn) -> bool:
    """Whether the lead's connection still answers: a session that is gone has released
    its lock, and another relay may lead already."""
    if conn.closed:
        return False
    try:
        await conn.execute(statement(_ANY, "leader_check"))
    except TRANSIENT_DB_ERRORS:
        return False
    return True


# leader_check names no table: any outbox's names render it.
_ANY = OutboxNames()
