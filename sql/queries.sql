-- Every statement the relay runs, one per `-- name --` header, with a one-line
-- description under it. relay.queries parses this file once; relay.store is the only
-- module that names these queries. Identifiers are filled in by relay.sqlnames
-- (see migrations/0001_outbox.sql); values are always bound parameters.
--
-- All times come from the database clock (now()), so clock skew between relay hosts
-- cannot distort lease decisions.

-- reap_expired --
-- Return rows whose lease expired to 'pending' (a crashed worker's), or to 'dead' once every attempt is spent (a poison message that kills its worker must stop).
WITH expired AS (
    SELECT id
      FROM {outbox}
     WHERE status = 'processing'
       AND lease_until < now()
     ORDER BY lease_until
     LIMIT 1000
       FOR UPDATE SKIP LOCKED
)
UPDATE {outbox} AS o
   SET status      = CASE WHEN o.attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
       last_error  = CASE WHEN o.attempts >= %(max_attempts)s
                          THEN 'lease expired after ' || o.attempts || ' attempts (did the worker crash while publishing?)'
                          ELSE o.last_error END,
       lease_owner = NULL,
       lease_until = NULL
  FROM expired
 WHERE o.id = expired.id
RETURNING o.id, o.aggregate_id, o.event_type, o.lease_version, o.attempts, o.status;

-- ingest --
-- Offer new ordered rows to the heads table, once every transaction that could still commit an earlier row has ended (the commit-order guard); one relay at a time. Returns how many heads it set and how long the oldest row has been held back by a still-running transaction.
WITH cursor AS (
    SELECT ingested_xid FROM {q_cursor} FOR UPDATE SKIP LOCKED
), horizon AS (
    SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xid
), fresh AS (
    -- Scalar subqueries, not joins, so the planner reads the (xid) index as a range.
    SELECT DISTINCT ON (o.aggregate_id) o.aggregate_id, o.id, o.xid, o.available_at
      FROM {outbox} AS o
     WHERE o.status = 'pending'
       AND o.ordered
       AND o.xid >= (SELECT ingested_xid FROM cursor)
       AND (o.xid < (SELECT xid FROM horizon) OR NOT %(guard)s)
     ORDER BY o.aggregate_id, o.xid, o.id
), offered AS (
    -- In aggregate order, like the heads trigger, so the two never deadlock.
    INSERT INTO {q_heads} AS h (aggregate_id, head_id, head_xid, ready_at)
    SELECT aggregate_id, id, xid, available_at FROM fresh ORDER BY aggregate_id
    ON CONFLICT (aggregate_id) DO UPDATE
       SET head_id  = excluded.head_id,
           head_xid = excluded.head_xid,
           ready_at = excluded.ready_at
     WHERE h.head_id IS NULL
    RETURNING 1
)
-- The cursor update is the statement itself, not one more CTE: as a CTE under a SELECT
-- the same update measured 15 ms instead of 0.5.
UPDATE {q_cursor} AS c
   SET ingested_xid = greatest(c.ingested_xid, horizon.xid)
  FROM horizon, cursor
RETURNING (SELECT count(*) FROM offered) AS offered,
          (SELECT extract(epoch FROM now() - min(o.created_at))::float8
             FROM {outbox} AS o
            WHERE %(guard)s
              AND o.status = 'pending'
              AND o.ordered
              AND o.xid >= horizon.xid) AS held_back_s;

-- claim_unordered --
-- Lease a batch of ready rows of unordered event types (plain SKIP LOCKED).
WITH picked AS (
    SELECT o.id
      FROM {outbox} AS o
     WHERE o.status = 'pending'
       AND NOT o.ordered
       AND o.available_at <= now()
     ORDER BY o.available_at, o.id
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {outbox} AS o
   SET status        = 'processing',
       lease_owner   = %(owner)s,
       lease_until   = now() + %(lease)s,
       lease_version = o.lease_version + 1,
       attempts      = o.attempts + 1
  FROM picked
 WHERE o.id = picked.id
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS payload,
          o.attempts, o.lease_version, extract(epoch FROM now() - o.created_at)::float8 AS age_s,
          false AS ordered;

-- claim_ordered --
-- Lease ready heads of aggregates: the earliest unfinished ordered row of each, never a row behind a pending, processing or dead one.
WITH picked AS (
    SELECT h.aggregate_id, h.head_id
      FROM {q_heads} AS h
     WHERE h.ready_at <= now()
     ORDER BY h.ready_at
     LIMIT %(batch)s
       FOR UPDATE SKIP LOCKED
), held AS (
    -- An array, not a join: the planner then probes the primary key for each picked head
    -- instead of hashing the whole heads table (10,000 blocked aggregates made it do that).
    UPDATE {q_heads} AS h
       SET ready_at = NULL
     WHERE h.aggregate_id = ANY (ARRAY(SELECT aggregate_id FROM picked))
), quiet AS (
    -- The heads are leased right here, so the heads trigger may skip this transaction's
    -- claims (the reaper ran before this, with the trigger on).
    SELECT set_config('outbox_relay.claiming', 'on', true) AS flag
)
UPDATE {outbox} AS o
   SET status        = 'processing',
       lease_owner   = %(owner)s,
       lease_until   = now() + %(lease)s,
       lease_version = o.lease_version + 1,
       attempts      = o.attempts + 1
  FROM picked, quiet
 WHERE o.id = picked.head_id
   AND o.status = 'pending'
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.payload::text AS payload,
          o.attempts, o.lease_version, extract(epoch FROM now() - o.created_at)::float8 AS age_s,
          true AS ordered;

-- store_settings --
-- Store this relay's ordering map, wake-up and commit-order-guard settings (rows are routed by the map when inserted); returns the previous map.
WITH previous AS (
    SELECT ord_default, ord_names, unord_names, ord_patterns, unord_patterns, notify FROM {q_settings}
)
UPDATE {q_settings}
   SET ord_default        = %(ord_default)s,
       ord_names          = %(ord_names)s,
       unord_names        = %(unord_names)s,
       ord_patterns       = %(ord_patterns)s,
       unord_patterns     = %(unord_patterns)s,
       notify             = %(notify)s,
       commit_order_guard = %(guard)s,
       updated_at         = now()
  FROM previous
RETURNING previous.ord_default, previous.ord_names, previous.unord_names, previous.ord_patterns,
          previous.unord_patterns, previous.notify;

-- store_ordering --
-- Store an ordering map alone (relay migrate --ordered ...), so rows written before the first relay start are routed by it.
UPDATE {q_settings}
   SET ord_default    = %(ord_default)s,
       ord_names      = %(ord_names)s,
       unord_names    = %(unord_names)s,
       ord_patterns   = %(ord_patterns)s,
       unord_patterns = %(unord_patterns)s,
       updated_at     = now();

-- finalize --
-- Write a batch of outcomes in one statement, each row fenced by status = 'processing' and its lease_version; returns the ids written.
UPDATE {outbox} AS o
   SET status       = f.status,
       available_at = CASE WHEN f.status = 'pending'
                           THEN now() + make_interval(secs => f.delay_s)
                           ELSE o.available_at END,
       attempts     = o.attempts - f.refund,
       last_error   = f.error,
       done_at      = CASE WHEN f.status = 'done' THEN now() END,
       lease_owner  = NULL,
       lease_until  = NULL
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[], %(statuses)s::text[],
              %(delays)s::float8[], %(errors)s::text[], %(refunds)s::int[])
       AS f(id, version, status, delay_s, error, refund)
 WHERE o.id = f.id
   AND o.status = 'processing'
   AND o.lease_version = f.version
RETURNING o.id;
