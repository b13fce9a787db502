-- 0004: database-enforced guards for ordered delivery.

-- At most one message in flight per ordered aggregate, whatever any claim query does:
-- a second ordered row of an aggregate cannot become 'processing' while one is.
CREATE UNIQUE INDEX {n_one_in_flight_idx} ON {outbox} (aggregate_id) WHERE ordered AND status = 'processing';

-- The commit-order guard (see 0002): on by default. Users whose producers lock each
-- aggregate before writing its events may turn it off (relay start --no-commit-order-guard)
-- so that a long-running transaction elsewhere no longer holds back ordered delivery.
ALTER TABLE {q_settings} ADD COLUMN commit_order_guard boolean NOT NULL DEFAULT true;

CREATE OR REPLACE FUNCTION {q_follow_heads}() RETURNS trigger
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
