-- 0004: per-aggregate order is commit order, numbered without gaps (aggregate_seq), and no
-- transaction elsewhere in the cluster can hold ordered delivery back.
--
-- Up to 0003 an aggregate was ordered by (xid, id) and a row became a head only below the
-- oldest running transaction id (the "commit-order guard"). Both were wrong: a transaction
-- id is assigned at a transaction's first write, not when it takes the aggregate's lock or
-- commits, so a producer that wrote another table first sorted before one that committed
-- earlier; and any transaction left open anywhere stopped every ordered delivery.
--
-- From here on:
-- * A deferred constraint trigger draws a commit stamp for every producer transaction that
--   wrote ordered rows, at COMMIT, while the transaction still holds every lock it took
--   (one row in <table>_commits per transaction, not per event). Stamps come from one
--   sequence with CACHE 1, so a transaction whose commit finished before another began
--   committing always has the smaller stamp.
-- * The ingest (one relay at a time, see sql/queries.sql) numbers newly committed ordered
--   rows: each gets its aggregate's next number, aggregate_seq = 1, 2, 3, ... with no gaps,
--   in the order the rows became visible to it, and by (stamp, id) among rows that became
--   visible together. Nothing waits for transactions that are still running: a row is
--   numbered once it is visible, and whatever commits later gets a later number.
-- * Heads, claims, explain and re-drive order an aggregate by aggregate_seq.
--
-- Kept only to stop relays older than this migration with a clear message (they would
-- otherwise offer heads by the old rule): the table <table>_cursor, the column
-- <table>_heads.head_xid and the setting commit_order_guard. A later migration drops them.

-- The position of an ordered row in its aggregate's sequence, set once by the ingest;
-- NULL until then, and always for unordered rows.
ALTER TABLE {outbox} ADD COLUMN aggregate_seq bigint;

-- Each aggregate's counter: the last aggregate_seq handed out. The sequence is gapless for
-- as long as this row is kept (the relay never deletes it).
ALTER TABLE {q_heads} ADD COLUMN last_seq bigint NOT NULL DEFAULT 0;

-- Serializes the ingest: the relay that holds this row's lock numbers; the others skip.
CREATE TABLE {q_ingest} (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton)
);
INSERT INTO {q_ingest} DEFAULT VALUES;

-- Commit stamps: one per producer transaction that wrote ordered rows, drawn at COMMIT.
-- CACHE 1 (the default) is required: with a cache, each session draws from its own block
-- of numbers and the stamps would no longer follow commit order across sessions.
CREATE SEQUENCE {q_commit_stamp} CACHE 1;

CREATE TABLE {q_commits} (
    stamp bigint PRIMARY KEY,  -- the ingest walks committed transactions in stamp order
    xid   xid8   NOT NULL      -- the transaction, matched to its rows' xid column
);

-- Runs at COMMIT (deferred) for every ordered row a transaction inserted; only the first
-- call of a transaction writes. The flag is transaction-local and keyed by the table's
-- oid, so two outboxes written in one transaction each get their stamp.
CREATE FUNCTION {q_stamp}() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    flag text := 'outbox_relay.stamped_' || TG_RELID;
BEGIN
    IF current_setting(flag, true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config(flag, 'on', true);
    INSERT INTO {q_commits} (stamp, xid) VALUES (nextval('{q_commit_stamp}'), pg_current_xact_id());
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER {n_stamp} AFTER INSERT ON {outbox}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordered)
    EXECUTE FUNCTION {q_stamp}();

-- New ordered rows the ingest has not numbered yet, found by their transaction. Dead too:
-- a row someone marked dead by hand before it was numbered still takes its place in the
-- sequence, and blocks its aggregate there.
DROP INDEX {q_ordered_new_idx};
CREATE INDEX IF NOT EXISTS {n_fresh_idx} ON {outbox} (xid, id)
    WHERE ordered AND aggregate_seq IS NULL AND status IN ('pending', 'dead');

-- "The next unfinished ordered row of this aggregate", for advancing a head. Unique: two
-- unfinished rows of one aggregate can never share a number. Numbered rows only, so a
-- producer's insert does not write this index.
DROP INDEX {q_aggregate_idx};
CREATE UNIQUE INDEX IF NOT EXISTS {n_aggregate_seq_idx} ON {outbox} (aggregate_id, aggregate_seq)
    WHERE ordered AND status IN ('pending', 'processing', 'dead') AND aggregate_seq IS NOT NULL;

-- Number the rows that exist now, in the order the previous version delivers them,
-- (xid, id). No producer writes meanwhile: ALTER TABLE above holds the table's exclusive
-- lock until this migration commits. Rows already finished keep no number.
WITH numbered AS (
    SELECT o.id, row_number() OVER (PARTITION BY o.aggregate_id ORDER BY o.xid, o.id) AS seq
      FROM {outbox} AS o
     WHERE o.ordered AND o.status IN ('pending', 'processing', 'dead')
)
UPDATE {outbox} AS o
   SET aggregate_seq = n.seq
  FROM numbered AS n
 WHERE o.id = n.id;

-- Every head anew from the numbers: the first unfinished row, ready when pending.
UPDATE {q_heads} SET head_id = NULL, head_xid = NULL, ready_at = NULL;
INSERT INTO {q_heads} AS h (aggregate_id, head_id, ready_at, last_seq)
SELECT DISTINCT ON (o.aggregate_id)
       o.aggregate_id, o.id, CASE WHEN o.status = 'pending' THEN o.available_at END,
       (SELECT count(*) FROM {outbox} AS c
         WHERE c.aggregate_id = o.aggregate_id AND c.ordered AND c.aggregate_seq IS NOT NULL)
  FROM {outbox} AS o
 WHERE o.ordered AND o.aggregate_seq IS NOT NULL
 ORDER BY o.aggregate_id, o.aggregate_seq
ON CONFLICT (aggregate_id) DO UPDATE
   SET head_id = excluded.head_id, ready_at = excluded.ready_at, last_seq = excluded.last_seq;

-- The heads trigger, now by aggregate_seq and without a horizon. The re-check on the
-- heads table guarded against offers computed on a stale snapshot by the old ingest; the
-- new ingest offers only rows it numbers in the same statement, which nobody else can
-- have finished, so it goes.
DROP TRIGGER {n_check_head} ON {q_heads};
DROP FUNCTION {q_check_head}();

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
            SELECT o.id, o.status, o.available_at
              FROM {outbox} AS o
             WHERE o.aggregate_id = n.aggregate_id
               AND o.ordered
               AND o.status IN ('pending', 'processing', 'dead')
               AND o.aggregate_seq IS NOT NULL
             ORDER BY o.aggregate_seq
             LIMIT 1
      ) AS nxt ON true
     WHERE n.ordered
       AND (TG_OP = 'DELETE' OR n.status = 'done')
       AND h.aggregate_id = n.aggregate_id
       AND h.head_id = n.id;
    RETURN NULL;
END
$$;

-- Relays older than this migration: their start-up writes commit_order_guard, and their
-- ingest advances <table>_cursor. Both now fail, with this message, before anything changes.
CREATE FUNCTION {q_refuse_old_relay}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'the outbox in schema % was upgraded to migration 0004 (ordering by aggregate_seq);'
                    ' this relay is older and must be upgraded before it runs against it', TG_TABLE_SCHEMA
        USING HINT = 'install the outbox-relay release that ships sql/migrations/0004_aggregate_seq.sql on every relay host';
END
$$;

CREATE TRIGGER {n_refuse_old_settings} BEFORE UPDATE OF commit_order_guard ON {q_settings}
    FOR EACH ROW EXECUTE FUNCTION {q_refuse_old_relay}();

CREATE TRIGGER {n_refuse_old_cursor} BEFORE UPDATE ON {q_cursor}
    FOR EACH ROW EXECUTE FUNCTION {q_refuse_old_relay}();
