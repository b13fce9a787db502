-- The privileges of the two roles besides the owner (relay.db.grants), one statement per
-- `-- name --` header with a one-line description, loaded beside queries.sql by
-- relay.db.statements. `relay migrate --grant-producer/--grant-relay` runs them and `relay
-- grants` prints them for a DBA. Placeholders as in queries.sql, plus {role} (the grantee)
-- and {database} (the current database): every one is a quoted identifier.
--
-- The owner (the role that ran `relay migrate`) alone holds DDL. The routing trigger a
-- producer's INSERT fires (<table>_route) runs with the producer's privileges and reads
-- <table>_settings; the commit-stamp trigger (<table>_stamp) runs as the owner (SECURITY
-- DEFINER, migration 0011), so producers get no grant on <table>_commits or its sequence.

-- grant_producer_schema --
-- Producers: reach the objects of the outbox's schema (no CREATE on it).
GRANT USAGE ON SCHEMA {schema} TO {role};

-- grant_producer_insert --
-- Producers: INSERT only the producer columns (event_id too, which relay.Outbox writes); the relay's columns come from defaults and the routing trigger.
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, headers, event_id) ON {outbox} TO {role};

-- grant_producer_returning --
-- Producers: INSERT ... RETURNING id reads the id column, and only that one; payloads and other rows' columns stay unreadable.
GRANT SELECT (id) ON {outbox} TO {role};

-- grant_producer_settings --
-- Producers: the routing trigger reads the ordering map and whether a relay waits for a wake-up.
GRANT SELECT ON {q_settings} TO {role};

-- grant_producer_functions --
-- Producers: the routing trigger calls the ordering map's function (also PUBLIC's by default, which deployments may revoke).
GRANT EXECUTE ON FUNCTION {q_is_ordered}(text, text[], text[], text[], text[], boolean) TO {role};

-- grant_relay_schema --
-- Relays: reach the objects of the outbox's schema (no CREATE on it: no DDL).
GRANT USAGE ON SCHEMA {schema} TO {role};

-- grant_relay_outbox --
-- Relays: claim, finalize, re-drive and prune rows; they never write events, so no INSERT.
GRANT SELECT, UPDATE, DELETE ON {outbox} TO {role};

-- grant_relay_side_tables --
-- Relays: the ingest, heads, wake-up bookkeeping, shared settings (relay settings set included) and the claim-check's objects (0019: recorded before they are stored, forgotten by the scheduled prune).
GRANT SELECT, INSERT, UPDATE, DELETE ON {q_heads}, {q_commits}, {q_settings}, {q_listeners}, {q_ingest}, {q_cursor}, {q_payloads} TO {role};

-- grant_relay_ledger --
-- Relays: every relay command checks the migrations applied, and only reads them.
GRANT SELECT ON {q_migrations} TO {role};

-- grant_relay_functions --
-- Relays: the functions the claims, the heads trigger, relay status, relay explain, relay replay and the console call, and the one that keeps partitions ahead (0018; it runs as the owner).
GRANT EXECUTE ON FUNCTION {q_is_ordered}(text, text[], text[], text[], text[], boolean), {q_unfinished_ordered}(text),
    {q_history}(text, text), {q_fingerprint}(text), {q_dead_group}(text),
    {q_event_id}(uuid, bigint, xid8, timestamptz), {q_keep_ahead}() TO {role};

-- grant_relay_temporary --
-- Relays: relay replay keeps its plan in a temporary table of its own session (sql/replay.sql).
GRANT TEMPORARY ON DATABASE {database} TO {role};

-- grants_role_exists --
-- Whether the grantee exists, so that a misspelt role is refused with one line before anything is granted.
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = %(role)s) AS found,
       current_database()::text AS database;
