-- Every statement the relay runs, one per `-- name --` header, with a one-line
-- description under it. relay.queries parses this file once; relay.store is the only
-- module that names these queries. Identifiers are filled in by relay.sqlnames
-- (see migrations/0001_outbox.sql); values are always bound parameters.
--
-- All times come from the database clock (now()), so clock skew between relay hosts
-- cannot distort lease decisions.

-- reap_expired --
-- Send rows whose lease expired with every attempt spent to 'dead' (a poison message that kills its worker must stop).
UPDATE {outbox}
   SET status      = 'dead',
       last_error  = 'lease expired after ' || attempts || ' attempts (did the worker crash while publishing?)',
       lease_owner = NULL,
       lease_until = NULL
 WHERE status = 'processing'
   AND lease_until < now()
   AND attempts >= %(max_attempts)s
RETURNING id, aggregate_id, event_type, lease_version, attempts;

-- claim_unordered --
-- Lease a batch of ready rows of unordered event types (plain SKIP LOCKED).
WITH picked AS (
    SELECT o.id
      FROM {outbox} AS o
     WHERE ((o.status = 'pending' AND o.available_at <= now())
         OR (o.status = 'processing' AND o.lease_until < now() AND o.attempts < %(max_attempts)s))
       AND NOT {q_is_ordered}(o.event_type, %(ord_names)s, %(unord_names)s,
                              %(ord_patterns)s, %(unord_patterns)s, %(ord_default)s)
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
-- Lease ready heads of aggregates for ordered event types: no earlier ordered row of the aggregate may be pending, processing or dead.
WITH picked AS (
    SELECT o.id
      FROM {outbox} AS o
     WHERE ((o.status = 'pending' AND o.available_at <= now())
         OR (o.status = 'processing' AND o.lease_until < now() AND o.attempts < %(max_attempts)s))
       AND {q_is_ordered}(o.event_type, %(ord_names)s, %(unord_names)s,
                          %(ord_patterns)s, %(unord_patterns)s, %(ord_default)s)
       AND NOT EXISTS (
            SELECT 1
              FROM {outbox} AS prev
             WHERE prev.aggregate_id = o.aggregate_id
               AND prev.id < o.id
               AND prev.status IN ('pending', 'processing', 'dead')
               AND {q_is_ordered}(prev.event_type, %(ord_names)s, %(unord_names)s,
                                  %(ord_patterns)s, %(unord_patterns)s, %(ord_default)s))
     ORDER BY o.id
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
          true AS ordered;

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
