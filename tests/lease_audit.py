"""An audit of every UPDATE of an outbox's rows, to check fencing after a fault scenario.

A trigger of the test's own records each UPDATE's status and lease_version, before and
after, in the same transaction as the UPDATE: what a failover loses of the outbox, it
loses of the audit too, and no more. The finalize writes the token its writer holds
(sql/queries.sql), so a write by a lease other than the row's current one shows in the
audit as a token that changed; the reaper, fenced by the lease's expiry instead, keeps it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import sql

from relay.db.names import OutboxNames
from tests.deliveries import Delivery

AUDIT_SQL = """
CREATE TABLE {audit} (n bigserial PRIMARY KEY, id bigint, old_status text, new_status text,
                      old_version bigint, new_version bigint);
CREATE FUNCTION {fn}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    INSERT INTO {audit} (id, old_status, new_status, old_version, new_version)
    VALUES (OLD.id, OLD.status::text, NEW.status::text, OLD.lease_version, NEW.lease_version);
    RETURN NULL;
END $$;
CREATE TRIGGER lease_audit AFTER UPDATE ON {outbox} FOR EACH ROW EXECUTE FUNCTION {fn}();
"""


def install_lease_audit(conn: psycopg.Connection[Any], names: OutboxNames) -> None:
    """Put the audit on ``names``' outbox (``conn`` must be able to create in its schema).
    The trigger writes as its owner: the relay's role needs no grant on the audit."""
    conn.execute(
        sql.SQL(AUDIT_SQL).format(
            audit=sql.Identifier(names.schema, "lease_audit"),
            fn=sql.Identifier(names.schema, "lease_audit_row"),
            outbox=sql.Identifier(names.schema, names.table),
        )
    )


def lease_audit_problems(
    conn: psycopg.Connection[Any], names: OutboxNames, deliveries: Iterable[Delivery]
) -> list[str]:
    """What the lease audit and the broker show against fencing: a claim that did not take
    the next lease_version, a finalize (processing -> done/pending/dead) that wrote a token
    other than the row's (a lease older or newer than the current one), a lease_version that
    went back (a claim lost in a failover whose token is handed out again, or a stale
    finalize), the same token delivered twice, or a done row whose token no delivery carried."""
    audit = sql.Identifier(names.schema, "lease_audit")
    problems = []
    for oid, old_s, new_s, old_v, new_v in conn.execute(
        sql.SQL("SELECT id, old_status, new_status, old_version, new_version FROM {} ORDER BY n").format(audit)
    ).fetchall():
        if new_v < old_v:
            problems.append(f"id {oid}: lease_version went back from {old_v} to {new_v}")
        elif new_s == "processing" and new_v != old_v + 1 and not (old_s == "processing" and new_v == old_v):
            # (processing -> processing at the same token moves only the lease's expiry)
            problems.append(f"id {oid}: a claim of a {old_s} row took lease_version {new_v} after {old_v}")
        elif old_s == "processing" and new_s in ("done", "pending", "dead") and new_v != old_v:
            problems.append(f"id {oid}: {old_s} -> {new_s} changed lease_version {old_v} -> {new_v}")
    tokens = Counter((d.outbox_id, d.lease_version) for d in deliveries)
    problems += [f"id {oid}: lease_version {v} delivered {n} times" for (oid, v), n in tokens.items() if n > 1]
    done = conn.execute(
        sql.SQL("SELECT id, lease_version FROM {} WHERE status = 'done'").format(
            sql.Identifier(names.schema, names.table)
        )
    ).fetchall()
    problems += [f"id {oid}: done by lease {v}, which no delivery carried" for oid, v in done if (oid, v) not in tokens]
    return problems
