-- 0002: claims whose cost does not grow with the table's history or the backlog's shape.
--
-- * Each row is routed (ordered or unordered) when it is inserted, by the ordering map
--   stored in <table>_settings (relay start writes it), so each strategy has its own
--   partial index and never walks the other's rows.
-- * Ordered rows are claimed through <table>_heads: one row per aggregate naming its
--   earliest unfinished ordered message and when that message may be claimed. Claims read
--   only heads that are ready, however many messages wait behind them or however many
--   aggregates are blocked by a dead head.
-- * Order within an aggregate is (xid, id): the writing transaction's id, then the row id.
--   A row becomes a head only once every transaction that could still commit an earlier
--   row has ended (below pg_snapshot_xmin), so producers need not lock the aggregate.

CREATE TABLE {q_settings} (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    ord_default    boolean NOT NULL DEFAULT true,
    ord_names      text[]  NOT NULL DEFAULT ARRAY[]::text[],
    unord_names    text[]  NOT NULL DEFAULT ARRAY[]::text[],
    ord_patterns   text[]  NOT NULL DEFAULT ARRAY[]::text[],
    unord_patterns text[]  NOT NULL DEFAULT ARRAY[]::text[],
    notify         boolean NOT NULL DEFAULT true,  -- wake idle relays on insert (LISTEN/NOTIFY)
    -- Off only where every producer locks the aggregate before writing (relay start
    -- --no-commit-order-guard): then a long-running transaction elsewhere no longer holds
    -- back ordered delivery.
    commit_order_guard boolean NOT NULL DEFAULT true,
    updated_at     timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {q_settings} DEFAULT VALUES;

ALTER TABLE {outbox}
    ADD COLUMN ordered boolean NOT NULL DEFAULT true,
    ADD COLUMN xid     xid8    NOT NULL DEFAULT pg_current_xact_id();

-- Route rows that existed before this migration with the default map (everything ordered).
-- Rows inserted from now on are routed by the trigger below.

CREATE FUNCTION {q_route}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    SELECT {q_is_ordered}(NEW.event_type, s.ord_names, s.unord_names, s.ord_patterns, s.unord_patterns, s.ord_default)
      INTO NEW.ordered
      FROM {q_settings} AS s;
    RETURN NEW;
END
$$;

CREATE TRIGGER {n_route} BEFORE INSERT ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {q_route}();

-- One NOTIFY per INSERT statement, not per row; delivered when the producer commits.
CREATE FUNCTION {q_notify}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    IF (SELECT s.notify FROM {q_settings} AS s) THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER {n_notify} AFTER INSERT ON {outbox}
    FOR EACH STATEMENT EXECUTE FUNCTION {q_notify}();

CREATE TABLE {q_heads} (
    aggregate_id text PRIMARY KEY,
    head_id      bigint,       -- earliest unfinished ordered row, by (xid, id); NULL: nothing waits
    head_xid     xid8,
    ready_at     timestamptz   -- when the head may be claimed; NULL while leased, dead or absent
);

CREATE INDEX {n_heads_ready_idx} ON {q_heads} (ready_at) WHERE ready_at IS NOT NULL;

-- Rows of transactions below this xid have been offered to the heads table.
CREATE TABLE {q_cursor} (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    ingested_xid xid8    NOT NULL
);
INSERT INTO {q_cursor} (ingested_xid) VALUES ('0');

-- Replace 0001's indexes by ones split per strategy.
DROP INDEX {q_pending_idx};
DROP INDEX {q_aggregate_idx};

-- Ready unordered rows, oldest-available first.
CREATE INDEX {n_unordered_ready_idx} ON {outbox} (available_at, id) WHERE status = 'pending' AND NOT ordered;

-- New ordered rows not yet offered to the heads table, by transaction.
CREATE INDEX {n_ordered_new_idx} ON {outbox} (xid) WHERE status = 'pending' AND ordered;

-- At most one message in flight per ordered aggregate, whatever any claim query does:
-- a second ordered row of an aggregate cannot become 'processing' while one is.
CREATE UNIQUE INDEX {n_one_in_flight_idx} ON {outbox} (aggregate_id) WHERE ordered AND status = 'processing';

-- "The next unfinished ordered row of this aggregate", for advancing a head: the
-- head-of-aggregate test of the design reference, in (xid, id) order.
CREATE INDEX {n_aggregate_idx} ON {outbox} (aggregate_id, xid, id)
    WHERE ordered AND status IN ('pending', 'processing', 'dead');

-- Heads of rows that existed before this migration (a dead head keeps blocking).
INSERT INTO {q_heads} (aggregate_id, head_id, head_xid, ready_at)
SELECT DISTINCT ON (o.aggregate_id)
       o.aggregate_id, o.id, o.xid, CASE WHEN o.status = 'pending' THEN o.available_at END
  FROM {outbox} AS o
 WHERE o.ordered AND o.status IN ('pending', 'processing', 'dead')
 ORDER BY o.aggregate_id, o.xid, o.id;

-- Keeps every head in step with its row, whoever changes the row: the relay's finalize,
-- the reaper, an operator's re-drive or skip, or a hand-written UPDATE or DELETE.
CREATE FUNCTION {q_follow_heads}() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    horizon xid8;
BEGIN
    -- The relay's ordered claim moves its heads itself (it leases them in the same
    -- statement) and says so for the rest of its transaction; nothing to follow then.
    IF current_setting('outbox_relay.claiming', true) = 'on' THEN
        RETURN NULL;
    END IF;

    -- Lock the heads this statement touched, in aggregate order (ingest locks in the same
    -- order, so the two cannot deadlock), and in a statement of their own, so that every
    -- statement below runs on a snapshot taken after any concurrent ingest of these
    -- aggregates has committed. (Written as a lateral lookup per changed row so that it
    -- stays an index probe: the planner has no statistics for a transition table.)
    PERFORM 1
       FROM (SELECT DISTINCT n.aggregate_id, n.id
               FROM changed AS n
              WHERE n.ordered
              ORDER BY n.aggregate_id) AS n,
            LATERAL (SELECT 1
                       FROM {q_heads} AS h
                      WHERE h.aggregate_id = n.aggregate_id
                        AND h.head_id = n.id
                        FOR UPDATE) AS locked;
    IF NOT FOUND THEN
        RETURN NULL;  -- no head changed: the common case for unordered rows
    END IF;

    IF TG_OP = 'UPDATE' THEN
        -- A head that is pending again (retry, defer, expired lease, re-drive) is ready at
        -- its available_at; one that is processing or dead is not claimable.
        UPDATE {q_heads} AS h
           SET ready_at = CASE WHEN n.status = 'pending' THEN n.available_at END
          FROM changed AS n
         WHERE n.ordered
           AND n.status IN ('pending', 'processing', 'dead')
           AND h.aggregate_id = n.aggregate_id
           AND h.head_id = n.id
           AND h.ready_at IS DISTINCT FROM CASE WHEN n.status = 'pending' THEN n.available_at END;
    END IF;

    -- A head that finished (done, or deleted): the next unfinished ordered row takes over,
    -- or nothing does, and ingest offers the aggregate's next new row when it comes. With
    -- the commit-order guard on, only rows that no still-running transaction can precede
    -- qualify.
    IF (SELECT s.commit_order_guard FROM {q_settings} AS s) THEN
        horizon := pg_snapshot_xmin(pg_current_snapshot());
    ELSE
        horizon := pg_snapshot_xmax(pg_current_snapshot());  -- every committed row
    END IF;
    UPDATE {q_heads} AS h
       SET head_id  = nxt.id,
           head_xid = nxt.xid,
           ready_at = CASE WHEN nxt.status = 'pending' THEN nxt.available_at END
      FROM changed AS n
      LEFT JOIN LATERAL (
            SELECT o.id, o.xid, o.status, o.available_at
              FROM {outbox} AS o
             WHERE o.aggregate_id = n.aggregate_id
               AND o.ordered
               AND o.status IN ('pending', 'processing', 'dead')
               AND o.xid < horizon
             ORDER BY o.xid, o.id
             LIMIT 1
      ) AS nxt ON true
     WHERE n.ordered
       AND (TG_OP = 'DELETE' OR n.status = 'done')
       AND h.aggregate_id = n.aggregate_id
       AND h.head_id = n.id;
    RETURN NULL;
END
$$;

-- The last word on a head: a row offered as head must still be unfinished when the offer
-- lands. An ingest computes its offers on the snapshot its statement started with; when a
-- concurrent finalize of that very row commits while the ingest waits for the head's lock,
-- the offer is stale. Queries here run on a fresh snapshot, so they see the finalize and
-- point the head at the aggregate's real next row instead.
CREATE FUNCTION {q_check_head}() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    horizon xid8;
BEGIN
    IF NEW.head_id IS NULL
       OR EXISTS (SELECT 1 FROM {outbox} AS o
                   WHERE o.id = NEW.head_id AND o.status IN ('pending', 'processing', 'dead')) THEN
        RETURN NEW;
    END IF;
    IF (SELECT s.commit_order_guard FROM {q_settings} AS s) THEN
        horizon := pg_snapshot_xmin(pg_current_snapshot());
    ELSE
        horizon := pg_snapshot_xmax(pg_current_snapshot());
    END IF;
    NEW.head_id := NULL;
    NEW.head_xid := NULL;
    NEW.ready_at := NULL;
    SELECT o.id, o.xid, CASE WHEN o.status = 'pending' THEN o.available_at END
      INTO NEW.head_id, NEW.head_xid, NEW.ready_at
      FROM {outbox} AS o
     WHERE o.aggregate_id = NEW.aggregate_id
       AND o.ordered
       AND o.status IN ('pending', 'processing', 'dead')
       AND o.xid < horizon
     ORDER BY o.xid, o.id
     LIMIT 1;
    RETURN NEW;
END
$$;

CREATE TRIGGER {n_check_head} BEFORE INSERT OR UPDATE OF head_id ON {q_heads}
    FOR EACH ROW EXECUTE FUNCTION {q_check_head}();

CREATE TRIGGER {n_follow_heads_upd} AFTER UPDATE ON {outbox}
    REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();

CREATE TRIGGER {n_follow_heads_del} AFTER DELETE ON {outbox}
    REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();
