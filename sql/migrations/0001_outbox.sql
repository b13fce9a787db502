-- 0001: the outbox table, the indexes the claims need, and the ordering classifier.
--
-- Placeholders are filled in by relay.db.names with quoted identifiers:
--   {outbox}  the outbox table, schema-qualified
--   {q_X}     a schema-qualified object named "<table>_X"
--   {n_X}     an unqualified name "<table>_X" (indexes, constraints)

CREATE TABLE {outbox} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),

    -- Everything below belongs to the relay; producers never write it.
    status         text        NOT NULL DEFAULT 'pending',
    available_at   timestamptz NOT NULL DEFAULT now(),  -- earliest claim time (backoff, defer)
    attempts       integer     NOT NULL DEFAULT 0,      -- claims so far; a crash counts as one
    lease_owner    text,                                -- who holds the lease, for people; fencing uses lease_version
    lease_until    timestamptz,                         -- database clock; past it the row may be re-claimed
    lease_version  bigint      NOT NULL DEFAULT 0,      -- fencing token, +1 on every claim
    last_error     text,
    done_at        timestamptz,

    CONSTRAINT {n_status_check} CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    CONSTRAINT {n_attempts_check} CHECK (attempts >= 0),
    -- A lease exists exactly while the row is processing; finalize and reap clear it.
    CONSTRAINT {n_lease_check} CHECK ((status = 'processing') = (lease_until IS NOT NULL))
);

-- Ready rows for the unordered claim, oldest-available first. Partial, so rows that are
-- done or dead (the bulk of a table that keeps history) are never scanned.
CREATE INDEX {n_pending_idx} ON {outbox} (available_at, id) WHERE status = 'pending';

-- Leases to expire: the reaper and the re-claim of a crashed worker's rows.
CREATE INDEX {n_leased_idx} ON {outbox} (lease_until) WHERE status = 'processing';

-- The head-of-aggregate test of the ordered claim: "is there an earlier unfinished row?"
CREATE INDEX {n_aggregate_idx} ON {outbox} (aggregate_id, id) WHERE status IN ('pending', 'processing', 'dead');

-- The ordering map evaluated in the database, so the claims can route rows by event
-- type. Twin of relay.ordering.OrderingMap.is_ordered; a property test keeps them equal.
CREATE FUNCTION {q_is_ordered}(
    event_type     text,
    ord_names      text[],
    unord_names    text[],
    ord_patterns   text[],
    unord_patterns text[],
    ord_default    boolean
) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN event_type = ANY (ord_names)      THEN true
        WHEN event_type = ANY (unord_names)    THEN false
        WHEN event_type ~ ANY (ord_patterns)   THEN true
        WHEN event_type ~ ANY (unord_patterns) THEN false
        ELSE ord_default
    END
$$;
