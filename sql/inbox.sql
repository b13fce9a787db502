-- The consumer's inbox (relay.inbox): in the consumer's own PostgreSQL, beside the data its
-- handlers change, so that recording a received event and applying its effect commit
-- together. Placeholders as in the outbox's files: {outbox} is the inbox table itself
-- (default public.inbox), {q_X} "<inbox>_X" in its schema.

-- inbox_create --
-- The inbox's tables and its receive function; safe to run again (relay.Inbox.migrate). The function is replaced, so a newer release's rules take effect at the next migrate.
CREATE TABLE IF NOT EXISTS {outbox} (
    -- One row per event applied: a delivery of an event id already here is a duplicate.
    event_id     uuid        PRIMARY KEY,
    received_at  timestamptz NOT NULL DEFAULT now()
);
-- For relay.Inbox.prune, which forgets old event ids in received_at order.
CREATE INDEX IF NOT EXISTS {n_received_idx} ON {outbox} (received_at);

CREATE TABLE IF NOT EXISTS {q_aggregates} (
    -- Per ordered aggregate: the epoch and the last aggregate_seq applied in it.
    aggregate_id text        PRIMARY KEY,
    epoch        text        NOT NULL,
    last_seq     bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT now()
);

-- What a delivery is: 'new' (recorded: apply its effect in the same transaction),
-- 'duplicate' (already applied: acknowledge it and do nothing), or 'gap' with the number
-- expected first (an earlier event of its aggregate has not been applied: nothing is
-- recorded; hold it and let it come again).
--
-- An event id recorded here is a duplicate, whatever its number says: a redelivery of an
-- event applied in an epoch the aggregate has since left must not wait for anything.
-- Ordered events are numbered per aggregate, gapless within an epoch
-- ('<timeline>.<first seq>.<token>', set by the relay's ingest): the same epoch continues
-- at last_seq + 1. A new epoch begins at its first seq S: after a promotion the new primary
-- numbers again from what it had replicated, so the numbers before S were handed out
-- (in earlier epochs) and S waits until last_seq >= S - 1 (numbers at or past S applied
-- in the old epoch came from transactions the failover lost: S is applied even so); an
-- aggregate the relay forgot starts again at S = 1.
-- An event of an epoch older than the stored one is stale: a duplicate. Older is an
-- earlier timeline, or on the same timeline a smaller token: since the outbox's migration
-- 0017 the token is 'n' and a counter the relay raises for every epoch it opens, so an
-- aggregate the relay forgot and started again is newer than its old epoch, and what the
-- old epoch still brings (a late redelivery, a replay, after Inbox.prune forgot its ids)
-- is a duplicate instead of a rewind. A token of 8 hex digits (random, before 0017) is
-- older than any counter on its timeline; two of those are not ordered (the arriving one
-- is taken as newer, as before).
-- An aggregate the inbox has never seen begins at 1 (or anywhere with p_first_unseen).
-- An event without an epoch (numbered before the outbox's migration 0015) continues the
-- stored epoch.
--
-- Concurrent receivers of one aggregate take its row's lock (FOR UPDATE) before they
-- decide, so they decide one after another, each on what the one before committed. An
-- aggregate without a row yet has nothing to lock: its first receivers serialize on a
-- transaction-scoped advisory lock keyed by this table and the aggregate, and the one that
-- waited reads the row the other committed (without it, with p_first_unseen, 6 committed
-- and then 5 from a second receiver rewound the aggregate to 5). Under REPEATABLE READ the
-- waiting one cannot see that row: its insert then fails with a serialization error, for
-- the caller to retry, never a rewind.
CREATE OR REPLACE FUNCTION {q_receive}(p_event_id uuid, p_aggregate_id text, p_seq bigint, p_epoch text,
                                       p_first_unseen boolean)
RETURNS TABLE (outcome text, expected bigint)
LANGUAGE plpgsql
AS $$
DECLARE
    cur_epoch   text;
    cur_seq     bigint;
    start       bigint;
    found_agg   boolean;
    newer       boolean;
    p_counter   bigint;
    cur_counter bigint;
BEGIN
    IF EXISTS (SELECT 1 FROM {outbox} AS i WHERE i.event_id = p_event_id) THEN
        RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
        RETURN;
    END IF;
    IF p_seq IS NOT NULL THEN
        SELECT a.epoch, a.last_seq INTO cur_epoch, cur_seq
          FROM {q_aggregates} AS a WHERE a.aggregate_id = p_aggregate_id FOR UPDATE;
        found_agg := FOUND;
        IF NOT found_agg THEN
            -- The two-key form: a key space apart from the single bigint keys applications
            -- use most; the table's oid keeps two inboxes apart.
            PERFORM pg_advisory_xact_lock('{q_aggregates}'::regclass::oid::int, hashtext(p_aggregate_id));
            SELECT a.epoch, a.last_seq INTO cur_epoch, cur_seq
              FROM {q_aggregates} AS a WHERE a.aggregate_id = p_aggregate_id FOR UPDATE;
            found_agg := FOUND;
        END IF;
        IF found_agg AND (p_epoch IS NULL OR p_epoch = cur_epoch) THEN
            IF p_seq <= cur_seq THEN
                RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
                RETURN;
            ELSIF p_seq > cur_seq + 1 THEN
                RETURN QUERY SELECT 'gap'::text, cur_seq + 1;
                RETURN;
            END IF;
        ELSIF p_epoch ~ '^[0-9]+\.[0-9]+\.' THEN
            -- '<timeline>.<first seq>.<token>': the epoch's first number.
            start := split_part(p_epoch, '.', 2)::bigint;
            IF NOT found_agg THEN
                IF p_seq <> 1 AND NOT p_first_unseen THEN
                    RETURN QUERY SELECT 'gap'::text, 1::bigint;
                    RETURN;
                END IF;
            ELSE
                -- Newer unless it is older on the timelines, then on the counters (an epoch
                -- from before 0015 is '': every epoch is newer than it).
                IF cur_epoch !~ '^[0-9]+\.' THEN
                    newer := true;
                ELSIF split_part(p_epoch, '.', 1)::bigint <> split_part(cur_epoch, '.', 1)::bigint THEN
                    newer := split_part(p_epoch, '.', 1)::bigint > split_part(cur_epoch, '.', 1)::bigint;
                ELSE
                    p_counter := substring(split_part(p_epoch, '.', 3) FROM '^n([0-9]{{1,18}})$')::bigint;
                    cur_counter := substring(split_part(cur_epoch, '.', 3) FROM '^n([0-9]{{1,18}})$')::bigint;
                    newer := CASE WHEN cur_counter IS NULL THEN true
                                  WHEN p_counter IS NULL THEN false
                                  ELSE p_counter > cur_counter END;
                END IF;
                IF NOT newer THEN
                    -- The stored epoch began only after every number before its first was
                    -- applied: what an older one still brings are numbers the failover
                    -- lost, or those of an aggregate the relay has since forgotten and
                    -- started again, superseded.
                    RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
                    RETURN;
                ELSIF p_seq <> start OR cur_seq < start - 1 THEN
                    RETURN QUERY SELECT 'gap'::text, least(cur_seq + 1, start);
                    RETURN;
                END IF;
            END IF;
        END IF;
    END IF;
    INSERT INTO {outbox} (event_id) VALUES (p_event_id) ON CONFLICT (event_id) DO NOTHING;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'duplicate'::text, NULL::bigint;
        RETURN;
    END IF;
    IF p_seq IS NOT NULL THEN
        INSERT INTO {q_aggregates} AS a (aggregate_id, epoch, last_seq)
        VALUES (p_aggregate_id, coalesce(p_epoch, cur_epoch, ''), p_seq)
        ON CONFLICT (aggregate_id) DO UPDATE
           SET epoch = excluded.epoch, last_seq = excluded.last_seq, updated_at = now();
    END IF;
    RETURN QUERY SELECT 'new'::text, NULL::bigint;
END
$$;

-- inbox_receive --
-- Record one delivery in the caller's transaction (relay.Inbox.receive): ['new' | 'duplicate' | 'gap', the number expected], and the transaction's start; NULL instead of the answer, with nothing recorded, when the transaction started at %(foreign)s (it holds another task's receipt).
-- The transaction's start tells one transaction of a connection from the next (a
-- connection runs them one after another, each starting later). CASE evaluates the
-- receive only when it is reached.
SELECT CASE WHEN g.began = CAST(%(foreign)s AS timestamptz) THEN NULL
            ELSE (SELECT ARRAY[r.outcome, CAST(r.expected AS text)]
                    FROM {q_receive}(CAST(%(event_id)s AS uuid), CAST(%(aggregate_id)s AS text),
                                     CAST(%(seq)s AS bigint), CAST(%(epoch)s AS text),
                                     CAST(%(first_unseen)s AS boolean)) AS r)
       END AS answer,
       g.began
  FROM (SELECT now() AS began) AS g

-- inbox_prune --
-- Forget event ids received before a time, at most %(limit)s of them per statement (relay.Inbox.prune repeats it). The aggregates' numbers are kept: an ordered event stays a duplicate by its number.
WITH old AS (
    SELECT i.event_id FROM {outbox} AS i
     WHERE i.received_at < CAST(%(before)s AS timestamptz)
     ORDER BY i.received_at
     LIMIT %(limit)s
)
DELETE FROM {outbox} AS i USING old WHERE i.event_id = old.event_id
