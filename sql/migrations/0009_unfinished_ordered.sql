-- 0009: one definition of an aggregate's unfinished ordered rows.
--
-- "The unfinished ordered rows of an aggregate" (numbered, and pending, processing or
-- dead) is what the heads trigger chooses the next head from, what `relay status` counts
-- behind a dead head and what `relay explain` counts. Each spelled the filter out itself;
-- from here on they all read this function. It is a plain SQL function, STABLE and not
-- STRICT, so PostgreSQL inlines it into each caller's plan: the same index scan on
-- <table>_aggregate_seq_idx as the filter written out (tests/test_heads.py checks the
-- plan), and no function call per row.
CREATE FUNCTION {q_unfinished_ordered}(aggregate text)
RETURNS TABLE (id bigint, status text, available_at timestamptz, aggregate_seq bigint)
LANGUAGE sql STABLE
AS $$
    SELECT o.id, o.status, o.available_at, o.aggregate_seq
      FROM {outbox} AS o
     WHERE o.aggregate_id = aggregate
       AND o.ordered
       AND o.status IN ('pending', 'processing', 'dead')
       AND o.aggregate_seq IS NOT NULL
$$;

-- The heads trigger of 0004, the next head now from the function; nothing else changes.
CREATE OR REPLACE FUNCTION {q_follow_heads}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- The relay's claim and ingest move their heads themselves, in the same statements,
    -- and say so for the rest of their transaction; nothing to follow then.
    IF current_setting('outbox_relay.claiming', true) = 'on' THEN
        RETURN NULL;
    END IF;

    -- Lock the heads this statement touched, in aggregate order (the ingest locks in the
    -- same order, so the two cannot deadlock), in a statement of their own: every statement
    -- below then runs on a snapshot taken after any concurrent ingest of these aggregates
    -- has committed, and sees the rows it numbered. (A lateral lookup per changed row
    -- keeps it an index probe: the planner has no statistics for a transition table.)
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

    -- A head that finished (done, or deleted): the unfinished row with the next number
    -- takes over, or nothing does, and the ingest offers the aggregate's next row when it
    -- numbers one.
    UPDATE {q_heads} AS h
       SET head_id  = nxt.id,
           ready_at = CASE WHEN nxt.status = 'pending' THEN nxt.available_at END
      FROM changed AS n
      LEFT JOIN LATERAL (
            SELECT u.id, u.status, u.available_at
              FROM {q_unfinished_ordered}(n.aggregate_id) AS u
             ORDER BY u.aggregate_seq
             LIMIT 1
      ) AS nxt ON true
     WHERE n.ordered
       AND (TG_OP = 'DELETE' OR n.status = 'done')
       AND h.aggregate_id = n.aggregate_id
       AND h.head_id = n.id;
    RETURN NULL;
END
$$;
