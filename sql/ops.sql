-- The operator tools' statements (relay status, explain, dead, release, prune, and the metrics'
-- gauges and readiness probe), one per `-- name --` header with a one-line description,
-- loaded beside queries.sql by relay.db.statements. Placeholders as in queries.sql; values are
-- always bound parameters.
--
-- A table that keeps history holds millions of done rows, so nothing here reads them by a
-- scan: unfinished rows are reached only through the claim's partial indexes, each subset
-- spelled with its index's exact predicate so the planner can use it:
--   status = 'pending' AND NOT ordered                 <table>_unordered_ready_idx
--   status = 'pending' AND ordered AND aggregate_seq IS NULL
--                                                      <table>_fresh_idx (committed, not numbered yet;
--                                                      it holds such dead rows too)
--   ordered AND status ... AND aggregate_seq IS NOT NULL
--                                                      <table>_aggregate_seq_idx, by aggregate (0004);
--                                                      read through <table>_unfinished_ordered (0009)
--   status = 'processing'                              <table>_leased_idx
--   status = 'dead'                                    <table>_dead_idx (0003)
-- and done rows only through the primary key, a chunk at a time (prune).

-- status_summary --
-- Counts of unfinished rows, oldest waiting message, expired leases, dead heads blocking their aggregates and the table's size, for `relay status` and the gauges; done is an estimate.
WITH unordered AS (
    SELECT count(*) AS n, min(created_at) AS oldest
      FROM {outbox}
     WHERE status = 'pending' AND NOT ordered
), ordered_pending AS (
    SELECT sum(n)::bigint AS n, min(oldest) AS oldest
      FROM (SELECT count(*) AS n, min(created_at) AS oldest
              FROM {outbox}
             WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL
            UNION ALL
            SELECT count(*), min(created_at)
              FROM {outbox}
             WHERE status = 'pending' AND ordered AND aggregate_seq IS NOT NULL) AS parts
), leased AS (
    SELECT count(*) AS n, count(*) FILTER (WHERE lease_until < now()) AS expired, min(created_at) AS oldest
      FROM {outbox}
     WHERE status = 'processing'
), dead AS (
    -- Counted from an index of dead rows alone; the oldest is the lowest id's (ids follow
    -- insertion), one heap read instead of one per dead row (a million took seconds).
    SELECT count(*) AS n,
           (SELECT o.created_at FROM {outbox} AS o
             WHERE o.id = (SELECT min(d.id) FROM {outbox} AS d WHERE d.status = 'dead')) AS oldest
      FROM {outbox}
     WHERE status = 'dead'
), blocked AS (
    -- From the dead rows (few) to their heads rows (primary key), never across all heads:
    -- the heads table keeps a row for every aggregate ever seen.
    SELECT count(*) AS n, min(o.created_at) AS oldest, coalesce(sum(w.behind), 0) AS behind
      FROM {outbox} AS o
      JOIN {q_heads} AS h ON h.aggregate_id = o.aggregate_id AND h.head_id = o.id
     CROSS JOIN LATERAL (
            SELECT count(*) - 1 AS behind FROM {q_unfinished_ordered}(o.aggregate_id)
           ) AS w
     WHERE o.status = 'dead' AND o.ordered  -- only an ordered row blocks (index dead_ordered, 0014)
), rel AS (
    SELECT c.oid
      FROM pg_class AS c
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE n.nspname = %(schema)s AND c.relname = %(table)s
)
SELECT now() AS now,
       unordered.n AS pending_unordered,
       ordered_pending.n AS pending_ordered,
       leased.n AS processing,
       leased.expired AS expired_leases,
       dead.n AS dead,
       least(unordered.oldest, ordered_pending.oldest, leased.oldest) AS oldest_waiting_at,
       dead.oldest AS oldest_dead_at,
       blocked.n AS blocked_aggregates,
       blocked.oldest AS oldest_blocked_at,
       blocked.behind AS waiting_behind_blocked,
       -- The statistics system's live-row count (kept current by inserts and deletes,
       -- corrected by every vacuum and analyze) minus the exact unfinished counts.
       -- A partitioned outbox (0018) keeps neither in its own entry: its partitions' sum
       -- (pg_partition_tree lists nothing for a plain table).
       (SELECT coalesce((SELECT sum(pg_stat_get_live_tuples(t.relid))::bigint
                           FROM pg_partition_tree(rel.oid) AS t WHERE t.isleaf),
                        pg_stat_get_live_tuples(rel.oid)) FROM rel) AS live_estimate,
       (SELECT coalesce((SELECT sum(pg_total_relation_size(t.relid))::bigint
                           FROM pg_partition_tree(rel.oid) AS t WHERE t.isleaf),
                        pg_total_relation_size(rel.oid)) FROM rel) AS total_bytes
  FROM unordered, ordered_pending, leased, dead, blocked;

-- status_wakeups --
-- The relay processes listening for wake-ups (their rows in <table>_listeners that have not expired), how many of them are idle, and whether producers notify now: the answer the relays keep in the settings row (migration 0008).
SELECT count(*) FILTER (WHERE l.expires_at > now()) AS listening,
       count(*) FILTER (WHERE l.expires_at > now() AND l.idle) AS idle,
       coalesce((SELECT s.notify AND s.wake_until > now() FROM {q_settings} AS s), false) AS producers_notify
  FROM {q_listeners} AS l;

-- status_attempts --
-- How many attempts the messages awaiting delivery (pending and processing) have used so far, as attempts -> count.
SELECT u.attempts, count(*) AS n
  FROM (
        SELECT attempts FROM {outbox} WHERE status = 'pending' AND NOT ordered
        UNION ALL
        SELECT attempts FROM {outbox} WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL
        UNION ALL
        SELECT attempts FROM {outbox} WHERE status = 'pending' AND ordered AND aggregate_seq IS NOT NULL
        UNION ALL
        SELECT attempts FROM {outbox} WHERE status = 'processing'
       ) AS u
 GROUP BY u.attempts
 ORDER BY u.attempts;

-- status_by_event_type --
-- Unfinished rows per event type and status, with the oldest of each, for `relay status --by-event-type`.
SELECT u.event_type, u.status, count(*) AS n, min(u.created_at) AS oldest,
       count(*) FILTER (WHERE u.status = 'processing' AND u.lease_until < now()) AS expired
  FROM (
        SELECT event_type, status, created_at, lease_until FROM {outbox} WHERE status = 'pending' AND NOT ordered
        UNION ALL
        SELECT event_type, status, created_at, lease_until FROM {outbox}
         WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL
        UNION ALL
        SELECT event_type, status, created_at, lease_until FROM {outbox}
         WHERE status = 'pending' AND ordered AND aggregate_seq IS NOT NULL
        UNION ALL
        SELECT event_type, status, created_at, lease_until FROM {outbox} WHERE status = 'processing'
        UNION ALL
        SELECT event_type, status, created_at, lease_until FROM {outbox} WHERE status = 'dead'
       ) AS u
 GROUP BY u.event_type, u.status
 ORDER BY u.event_type, u.status;

-- console_event_types --
-- For the console's overview, bounded: the %(limit)s event types with the most messages awaiting delivery (pending or processing: one row per type and status, as status_by_event_type), each with its dead count (index dead_type, 0014), and how many event types await delivery in all. Dead messages are grouped on /dead, so the dead rows are counted only for the types listed: the whole aggregation of a million dead rows took 2 s.
WITH per AS (
    SELECT u.event_type, u.status, count(*) AS n, min(u.created_at) AS oldest,
           count(*) FILTER (WHERE u.status = 'processing' AND u.lease_until < now()) AS expired
      FROM (
            SELECT event_type, status, created_at, lease_until FROM {outbox} WHERE status = 'pending' AND NOT ordered
            UNION ALL
            SELECT event_type, status, created_at, lease_until FROM {outbox}
             WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL
            UNION ALL
            SELECT event_type, status, created_at, lease_until FROM {outbox}
             WHERE status = 'pending' AND ordered AND aggregate_seq IS NOT NULL
            UNION ALL
            SELECT event_type, status, created_at, lease_until FROM {outbox} WHERE status = 'processing'
           ) AS u
     GROUP BY u.event_type, u.status
), types AS (
    SELECT per.event_type, sum(per.n) AS total FROM per GROUP BY per.event_type
), top AS (
    SELECT types.event_type FROM types ORDER BY types.total DESC, types.event_type LIMIT %(limit)s
)
SELECT per.event_type, per.status, per.n, per.oldest, per.expired, (SELECT count(*) FROM types) AS types
  FROM per
  JOIN top ON top.event_type = per.event_type
UNION ALL
SELECT top.event_type, 'dead', d.n, NULL, 0, (SELECT count(*) FROM types)
  FROM top
 CROSS JOIN LATERAL (SELECT count(*) AS n FROM {outbox} AS o WHERE o.status = 'dead' AND o.event_type = top.event_type) AS d
 WHERE d.n > 0
 ORDER BY 1, 2;

-- console_payload_parts --
-- One message's payload as JSON text, UTF-8, in parts of %(size)s bytes, in order, for a server-side cursor that the console reads one part at a time: the text is rendered once (the subquery) and cut as bytes (substr on text counts characters from the start every time: 26 MB took 8.6 s), never held whole by the console. No ORDER BY, which would make the server build every part before the first is sent: the nested loop hands them out in generate_series' order.
WITH p AS MATERIALIZED (  -- rendered once, not once per part
    SELECT convert_to(o.payload::text, 'UTF8') AS b FROM {outbox} AS o WHERE o.id = %(id)s
)
SELECT substring(p.b FROM g * %(size)s::integer + 1 FOR %(size)s::integer) AS part
  FROM p, generate_series(0, greatest(length(p.b) - 1, 0) / %(size)s::integer) AS g;

-- explain_head --
-- An aggregate's heads row (its counter too) and the message it names, with the database clock.
SELECT now() AS now,
       h.aggregate_id IS NOT NULL AS has_heads_row,
       h.head_id, h.ready_at, h.last_seq,
       o.id, o.event_type, o.status, o.attempts, o.last_error, o.available_at, o.lease_owner,
       o.lease_until, o.lease_version, o.created_at, o.ordered, o.aggregate_seq,
       o.resolution, o.resolved_by, o.resolved_at, o.resolved_note
  FROM (SELECT %(aggregate_id)s::text AS aggregate_id) AS a
  LEFT JOIN {q_heads} AS h ON h.aggregate_id = a.aggregate_id
  LEFT JOIN {outbox} AS o ON o.id = h.head_id;

-- explain_ordered --
-- An aggregate's unfinished ordered rows: the numbered ones by status, and those committed but not numbered by an ingest yet.
SELECT count(*) AS n,
       count(*) FILTER (WHERE u.status = 'pending') AS pending,
       count(*) FILTER (WHERE u.status = 'processing') AS processing,
       count(*) FILTER (WHERE u.status = 'dead') AS dead,
       (SELECT count(*)
          FROM {outbox}
         WHERE status = 'pending' AND ordered AND aggregate_seq IS NULL
           AND aggregate_id = %(aggregate_id)s) AS not_numbered
  FROM {q_unfinished_ordered}(%(aggregate_id)s) AS u;

-- explain_unordered --
-- An aggregate's unfinished unordered rows by status (through the claim's partial indexes: a scan of that backlog, never of the history).
SELECT (SELECT count(*) FROM {outbox}
         WHERE status = 'pending' AND NOT ordered AND aggregate_id = %(aggregate_id)s) AS pending,
       (SELECT count(*) FROM {outbox}
         WHERE status = 'processing' AND NOT ordered AND aggregate_id = %(aggregate_id)s) AS processing,
       (SELECT count(*) FROM {outbox}
         WHERE status = 'dead' AND NOT ordered AND aggregate_id = %(aggregate_id)s) AS dead;

-- dead_list --
-- Dead messages matching the filters (each filter NULL when not given), in id order, with the total count of matches and whether each is the head blocking its aggregate.
SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.attempts, o.created_at, o.last_error,
       o.ordered, o.lease_version, o.resolution, o.resolved_by, o.resolved_at,
       EXISTS (SELECT 1 FROM {q_heads} AS h WHERE h.aggregate_id = o.aggregate_id AND h.head_id = o.id) AS blocking,
       count(*) OVER () AS total,
       now() AS now
  FROM {outbox} AS o
 WHERE o.status = 'dead'
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY (%(event_types)s::text[]))
   AND (%(aggregate_id)s::text IS NULL OR o.aggregate_id = %(aggregate_id)s::text)
   AND (%(error)s::text IS NULL OR strpos(lower(coalesce(o.last_error, '')), lower(%(error)s::text)) > 0)
   AND (%(created_after)s::timestamptz IS NULL OR o.created_at >= %(created_after)s::timestamptz)
   AND (%(created_before)s::timestamptz IS NULL OR o.created_at < %(created_before)s::timestamptz)
 ORDER BY o.id
 LIMIT %(limit)s;

-- dead_groups --
-- Dead messages matching the filters grouped by error (dead_group, migration 0014), largest group first, one page of groups: counted from the (dead_group, id) index, nothing per row but the count. For the groups on the page only: the fingerprint and the last error (its first 2,000 characters and its length), the event types among the group's first 100 messages, and how many of its ordered messages hold up their aggregate.
WITH grouped AS (
    SELECT o.dead_group, count(*) AS n, min(o.id) AS first_id, max(o.id) AS last_id
      FROM {outbox} AS o
     WHERE o.status = 'dead'
       AND (%(group)s::bigint IS NULL OR o.dead_group = %(group)s::bigint)
       AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY (%(event_types)s::text[]))
       AND (%(aggregate_id)s::text IS NULL OR o.aggregate_id = %(aggregate_id)s::text)
       AND (%(error)s::text IS NULL OR strpos(lower(coalesce(o.last_error, '')), lower(%(error)s::text)) > 0)
       AND (%(created_after)s::timestamptz IS NULL OR o.created_at >= %(created_after)s::timestamptz)
       AND (%(created_before)s::timestamptz IS NULL OR o.created_at < %(created_before)s::timestamptz)
     GROUP BY o.dead_group
), page AS (
    SELECT g.*, count(*) OVER () AS groups, sum(g.n) OVER () AS total
      FROM grouped AS g
     ORDER BY g.n DESC, g.first_id
     LIMIT %(limit)s OFFSET %(offset)s
)
SELECT coalesce(p.dead_group, 0) AS dead_group, p.n, p.first_id, p.last_id, p.groups, p.total,
       {q_fingerprint}(s.last_error) AS fingerprint,
       left(s.last_error, 2000) AS sample_error, length(s.last_error) AS sample_length,
       ARRAY(SELECT DISTINCT t.event_type
               FROM (SELECT b.event_type FROM {outbox} AS b
                      WHERE b.status = 'dead' AND b.dead_group = p.dead_group
                      ORDER BY b.id LIMIT 100) AS t
              ORDER BY 1) AS event_types,
       (SELECT count(*) FROM {outbox} AS b
         WHERE b.status = 'dead' AND b.dead_group = p.dead_group AND b.ordered
           AND EXISTS (SELECT 1 FROM {q_heads} AS h WHERE h.aggregate_id = b.aggregate_id AND h.head_id = b.id)) AS blocking,
       now() AS now
  FROM page AS p
  JOIN {outbox} AS s ON s.id = p.last_id
 ORDER BY p.n DESC, p.first_id;

-- dead_ids --
-- The ids of the dead messages matching the filters (and in a group, when given), in id order: what a re-drive or skip of a filter or group takes; nothing else is read.
SELECT o.id
  FROM {outbox} AS o
 WHERE o.status = 'dead'
   AND (%(group)s::bigint IS NULL OR o.dead_group = %(group)s::bigint)
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY (%(event_types)s::text[]))
   AND (%(aggregate_id)s::text IS NULL OR o.aggregate_id = %(aggregate_id)s::text)
   AND (%(error)s::text IS NULL OR strpos(lower(coalesce(o.last_error, '')), lower(%(error)s::text)) > 0)
   AND (%(created_after)s::timestamptz IS NULL OR o.created_at >= %(created_after)s::timestamptz)
   AND (%(created_before)s::timestamptz IS NULL OR o.created_at < %(created_before)s::timestamptz)
 ORDER BY o.id
 LIMIT %(limit)s;

-- dead_group_page --
-- One page of a group's dead messages matching the filters, in id order after %(after)s (keyset paging over the (dead_group, id) index); each error cut to its first 2,000 characters.
SELECT o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.attempts, o.created_at, left(o.last_error, 2000) AS last_error,
       o.ordered, o.lease_version, o.resolution, o.resolved_by, o.resolved_at,
       EXISTS (SELECT 1 FROM {q_heads} AS h WHERE h.aggregate_id = o.aggregate_id AND h.head_id = o.id) AS blocking,
       0 AS total,
       now() AS now
  FROM {outbox} AS o
 WHERE o.status = 'dead'
   AND o.dead_group = %(group)s::bigint
   AND o.id > %(after)s::bigint
   AND (%(event_types)s::text[] IS NULL OR o.event_type = ANY (%(event_types)s::text[]))
   AND (%(aggregate_id)s::text IS NULL OR o.aggregate_id = %(aggregate_id)s::text)
   AND (%(error)s::text IS NULL OR strpos(lower(coalesce(o.last_error, '')), lower(%(error)s::text)) > 0)
   AND (%(created_after)s::timestamptz IS NULL OR o.created_at >= %(created_after)s::timestamptz)
   AND (%(created_before)s::timestamptz IS NULL OR o.created_at < %(created_before)s::timestamptz)
 ORDER BY o.id
 LIMIT %(limit)s;

-- dead_lock --
-- Lock the given rows in id order (the order every re-drive and skip takes its locks in, so two operators cannot deadlock) and return their state, to refuse unknown or not-dead ids before anything changes.
SELECT id, status, aggregate_id, event_type, lease_version, ordered
  FROM {outbox}
 WHERE id = ANY (%(ids)s::bigint[])
 ORDER BY id
   FOR UPDATE;

-- dead_retry --
-- Re-drive dead rows: back to pending with attempts reset, available now (one timestamp, so the claims take them in id order), fenced by status = 'dead'; last_error is kept for the record.
UPDATE {outbox}
   SET status        = 'pending',
       attempts      = 0,
       available_at  = now(),
       resolution    = 'retried',
       resolved_by   = %(by)s,
       resolved_at   = now(),
       resolved_note = %(note)s
 WHERE id = ANY (%(ids)s::bigint[])
   AND status = 'dead'
RETURNING id, aggregate_id, event_type, lease_version, ordered;

-- dead_skip --
-- Mark dead rows finished without delivery, recording who and why, fenced by status = 'dead'; the heads trigger moves each aggregate on to its next message.
UPDATE {outbox}
   SET status        = 'done',
       done_at       = now(),
       resolution    = 'skipped',
       resolved_by   = %(by)s,
       resolved_at   = now(),
       resolved_note = %(note)s
 WHERE id = ANY (%(ids)s::bigint[])
   AND status = 'dead'
RETURNING id, aggregate_id, event_type, lease_version, ordered;

-- release_by_owner --
-- The processing rows an owner holds (lease_owner exactly OWNER, or OWNER:... for every worker of a host or process), locked in id order, for relay release.
SELECT now() AS now, id, status, aggregate_id, event_type, lease_owner, lease_version, lease_until, attempts,
       ordered, aggregate_seq
  FROM {outbox}
 WHERE status = 'processing'
   AND (lease_owner = %(owner)s OR starts_with(lease_owner, %(owner)s || ':'))
 ORDER BY id
   FOR UPDATE;

-- release_by_ids --
-- The given rows whatever their status, locked in id order, so relay release can report those it will not touch (unknown, not processing, another owner's).
SELECT now() AS now, id, status, aggregate_id, event_type, lease_owner, lease_version, lease_until, attempts,
       ordered, aggregate_seq
  FROM {outbox}
 WHERE id = ANY (%(ids)s::bigint[])
 ORDER BY id
   FOR UPDATE;

-- release_holders --
-- Who holds leases now, with how many rows, for the error of a relay release --owner that matches nothing.
SELECT lease_owner, count(*) AS n
  FROM {outbox}
 WHERE status = 'processing'
 GROUP BY lease_owner
 ORDER BY count(*) DESC, lease_owner
 LIMIT 10;

-- release --
-- Hand leased rows back the way the reaper hands back an expired lease (to 'pending', or to 'dead' once every attempt is spent; no attempt refunded), fenced by status = 'processing' and the lease_version read under the lock, which goes up by one so the old owner's late finalize matches nothing; the heads trigger makes a released ordered head claimable again.
UPDATE {outbox} AS o
   SET status        = CASE WHEN o.attempts >= %(max_attempts)s THEN 'dead' ELSE 'pending' END,
       last_error    = CASE WHEN o.attempts >= %(max_attempts)s
                            THEN 'lease released by an operator after ' || o.attempts
                                 || ' attempts (held by ' || o.lease_owner || ')'
                            ELSE o.last_error END,
       lease_owner   = NULL,
       lease_until   = NULL,
       lease_version = o.lease_version + 1,
       resolution    = 'released',
       resolved_by   = %(by)s,
       resolved_at   = now(),
       resolved_note = %(note)s
  FROM unnest(%(ids)s::bigint[], %(versions)s::bigint[]) AS r(id, version)
 WHERE o.id = r.id
   AND o.status = 'processing'
   AND o.lease_version = r.version
RETURNING o.id, o.status, o.lease_version;

-- prune_cutoff --
-- The prune cutoff by the database clock, fixed once per run so every chunk applies the same one.
SELECT now() - %(older_than)s::interval AS cutoff;

-- prune_chunk --
-- Delete the finished rows older than the cutoff among the next chunk of ids (one short statement); reports the chunk's last id and whether every row of it was created after the cutoff. Dead rows go only with include_dead, and only unordered ones: a dead ordered row stops its aggregate (now, or once it is the head), and deleting it would unblock the aggregate and leave a hole in aggregate_seq that nothing records (prune_blocking_page finds them; relay prune --skip-blocking skips them, recorded).
WITH chunk AS (
    SELECT id, status, created_at, done_at, ordered
      FROM {outbox}
     WHERE id > %(after_id)s
     ORDER BY id
     LIMIT %(batch)s
), doomed AS (
    SELECT id
      FROM chunk
     WHERE (status = 'done' AND done_at < %(cutoff)s)
        OR (%(include_dead)s AND status = 'dead' AND NOT ordered AND created_at < %(cutoff)s)
), deleted AS (
    -- The condition again on the row itself: a row changed since the chunk was read (a
    -- dead row re-driven meanwhile) is re-checked in its new version and kept.
    DELETE FROM {outbox} AS o
     USING doomed
     WHERE o.id = doomed.id
       AND ((o.status = 'done' AND o.done_at < %(cutoff)s)
            OR (%(include_dead)s AND o.status = 'dead' AND NOT o.ordered AND o.created_at < %(cutoff)s))
    RETURNING o.status
)
SELECT (SELECT count(*) FROM chunk) AS scanned,
       (SELECT max(id) FROM chunk) AS last_id,
       coalesce((SELECT bool_and(created_at >= %(cutoff)s) FROM chunk), true) AS all_newer,
       (SELECT count(*) FILTER (WHERE status = 'done') FROM deleted) AS done,
       (SELECT count(*) FILTER (WHERE status = 'dead') FROM deleted) AS dead;

-- prune_chunk_count --
-- What prune_chunk would delete in the next chunk of ids, counted instead of deleted (prune --dry-run).
WITH chunk AS (
    SELECT id, status, created_at, done_at, ordered
      FROM {outbox}
     WHERE id > %(after_id)s
     ORDER BY id
     LIMIT %(batch)s
)
SELECT count(*) AS scanned,
       max(id) AS last_id,
       coalesce(bool_and(created_at >= %(cutoff)s), true) AS all_newer,
       count(*) FILTER (WHERE status = 'done' AND done_at < %(cutoff)s) AS done,
       count(*) FILTER (WHERE %(include_dead)s AND status = 'dead' AND NOT ordered AND created_at < %(cutoff)s) AS dead
  FROM chunk;

-- prune_blocking_count --
-- The dead ordered rows created before the cutoff, which prune never deletes (see prune_chunk): how many, of how many aggregates, and the first aggregate ids (a sample to name). Through the dead index: dead rows only.
SELECT count(*) AS n,
       count(DISTINCT o.aggregate_id) AS aggregates,
       ARRAY(SELECT DISTINCT d.aggregate_id
               FROM {outbox} AS d
              WHERE d.status = 'dead' AND d.ordered AND d.created_at < %(cutoff)s
              ORDER BY d.aggregate_id
              LIMIT %(sample)s) AS sample
  FROM {outbox} AS o
 WHERE o.status = 'dead' AND o.ordered AND o.created_at < %(cutoff)s;

-- prune_blocking_page --
-- The next dead ordered rows created before the cutoff, in id order after %(after_id)s, for relay prune --skip-blocking to skip a page at a time (relay.ops.deadletters.skip records each: who, why, when).
SELECT o.id
  FROM {outbox} AS o
 WHERE o.status = 'dead' AND o.ordered AND o.created_at < %(cutoff)s
   AND o.id > %(after_id)s
 ORDER BY o.id
 LIMIT %(batch)s;

-- prune_heads_turn --
-- Take the ingest's turn (waiting: an ingest holds it for milliseconds) before forgetting heads, so that no ingest numbers rows while prune_heads_chunk decides, and that statement's snapshot, taken after this one, sees everything every earlier ingest numbered.
SELECT 1 FROM {q_ingest} FOR UPDATE;

-- prune_heads_chunk --
-- Forget the heads rows (the aggregate_seq counters) of idle aggregates among the next chunk of heads by aggregate_id: nothing unfinished (no head, no numbered row left), no committed row waiting to be numbered, and nothing numbered since the cutoff. Such an aggregate starts again at aggregate_seq 1 if it comes back. Counts instead of deleting when dry_run. After prune_heads_turn, in its transaction.
WITH chunk AS (
    SELECT h.aggregate_id
      FROM {q_heads} AS h
     WHERE h.aggregate_id > %(after)s
     ORDER BY h.aggregate_id
     LIMIT %(batch)s
), waiting AS (
    -- Committed ordered rows no ingest has numbered yet (a few, between two ingests; the
    -- fresh index holds nothing else), by aggregate: their aggregates are not idle.
    SELECT DISTINCT o.aggregate_id
      FROM {outbox} AS o
     WHERE o.ordered AND o.aggregate_seq IS NULL AND o.status IN ('pending', 'dead')
), idle AS (
    SELECT h.aggregate_id
      FROM {q_heads} AS h
      JOIN chunk AS c ON c.aggregate_id = h.aggregate_id
     WHERE h.head_id IS NULL
       AND h.numbered_at < %(cutoff)s
       AND NOT EXISTS (SELECT 1 FROM {q_unfinished_ordered}(h.aggregate_id))
       AND NOT EXISTS (SELECT 1 FROM waiting AS w WHERE w.aggregate_id = h.aggregate_id)
), forgotten AS (
    DELETE FROM {q_heads} AS h
     USING idle
     WHERE h.aggregate_id = idle.aggregate_id
       AND NOT %(dry_run)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM chunk) AS scanned,
       (SELECT max(c.aggregate_id) FROM chunk AS c) AS last,
       (SELECT count(*) FROM idle) AS idle,
       (SELECT count(*) FROM forgotten) AS forgotten;

-- prune_heads_waiting --
-- How many committed ordered rows wait to be numbered, counted up to %(limit)s: prune forgets no heads while a backlog waits (every chunk would read it), and says so.
SELECT count(*) AS n
  FROM (SELECT 1
          FROM {outbox} AS o
         WHERE o.ordered AND o.aggregate_seq IS NULL AND o.status IN ('pending', 'dead')
         LIMIT %(limit)s) AS w;

-- ready_probe --
-- Readiness: the database answers and the outbox table is there and readable.
SELECT 1 FROM {outbox} LIMIT 0;

-- claim_probe --
-- Readiness of a relay: it could claim now. A zero-row FOR UPDATE fails as a claim would when the table is missing, this role may not lock its rows (grants revoked), or the database takes no writes (read-only, a standby).
SELECT 1 FROM {outbox} LIMIT 0 FOR UPDATE;

-- console_blocked --
-- Ordered aggregates whose head is dead, oldest dead head first, with how many ordered messages wait behind each: from the dead rows (few) to their heads rows, as status_summary counts them.
SELECT now() AS now, o.id, o.aggregate_type, o.aggregate_id, o.event_type, o.attempts, o.created_at,
       o.last_error, o.aggregate_seq, w.behind
  FROM {outbox} AS o
  JOIN {q_heads} AS h ON h.aggregate_id = o.aggregate_id AND h.head_id = o.id
 CROSS JOIN LATERAL (
        SELECT count(*) - 1 AS behind FROM {q_unfinished_ordered}(o.aggregate_id)
       ) AS w
 WHERE o.status = 'dead'
 ORDER BY o.created_at, o.id
 LIMIT %(limit)s;

-- console_message --
-- One message whole, for the console's message page: payload, headers, attempts, last error, operator action, and its aggregate's head and counter.
SELECT now() AS now, o.id, o.aggregate_type, o.aggregate_id, o.event_type,
       left(p.text, 1024) AS payload, length(p.text) AS payload_length,
       left(o.headers::text, 65536) AS headers, o.created_at, o.status, o.available_at, o.attempts, o.lease_owner,
       o.lease_until, o.lease_version, left(o.last_error, 8192) AS last_error, length(o.last_error) AS last_error_length,
       o.done_at, o.ordered, o.aggregate_seq,
       o.resolution, o.resolved_by, o.resolved_at, o.resolved_note,
       h.head_id, head.aggregate_seq AS head_seq, h.last_seq
  FROM {outbox} AS o
  CROSS JOIN LATERAL (SELECT o.payload::text AS text OFFSET 0) AS p  -- OFFSET 0: rendered once, not per use
  LEFT JOIN {q_heads} AS h ON h.aggregate_id = o.aggregate_id
  LEFT JOIN {outbox} AS head ON head.id = h.head_id
 WHERE o.id = %(id)s;

-- console_aggregate_messages --
-- An aggregate's messages, newest first: every unfinished one (through the partial indexes of unfinished rows) and the finished ones among the newest %(recent)s ids of the table (a primary-key range: no index covers the done history by aggregate, and a scan of it all would grow with the table).
WITH recent AS (
    SELECT o.id
      FROM {outbox} AS o
     WHERE o.aggregate_id = %(aggregate_id)s
       AND o.id > (SELECT coalesce(max(id), 0) - %(recent)s FROM {outbox})
), unfinished AS (
    -- One branch per partial index, each with that index's predicate: numbered ordered,
    -- pending unordered, leased, dead, and ordered rows not numbered yet.
    SELECT u.id FROM {q_unfinished_ordered}(%(aggregate_id)s) AS u
    UNION
    SELECT o.id FROM {outbox} AS o
     WHERE o.aggregate_id = %(aggregate_id)s AND o.status = 'pending' AND NOT o.ordered
    UNION
    SELECT o.id FROM {outbox} AS o WHERE o.aggregate_id = %(aggregate_id)s AND o.status = 'processing'
    UNION
    SELECT o.id FROM {outbox} AS o WHERE o.aggregate_id = %(aggregate_id)s AND o.status = 'dead'
    UNION
    SELECT o.id FROM {outbox} AS o
     WHERE o.aggregate_id = %(aggregate_id)s AND o.ordered AND o.aggregate_seq IS NULL
       AND o.status IN ('pending', 'dead')
)
SELECT o.id, o.event_type, o.status, o.attempts, o.created_at, o.done_at, o.ordered, o.aggregate_seq,
       o.last_error, o.resolution
  FROM {outbox} AS o
 WHERE o.id IN (SELECT id FROM recent UNION SELECT id FROM unfinished)
 ORDER BY o.id DESC
 LIMIT %(limit)s;

-- payloads_unneeded --
-- Of the next %(batch)s stored objects in the outbox's id order after (%(after_id)s, %(after_ref)s), those whose row has left history (relay prune deleted it, or dropped its partition), and the last one read: relay prune deletes them from the store, then forgets them (payloads_forget), and reads on from there. A page of the (outbox_id, ref) index (materialized, so that the planner knows its size) joined to the outbox by id: probes of its primary key in order. Written as NOT EXISTS over the whole table, the planner chose an anti-join that scanned the outbox for every page (141 s for 1,000,000 objects).
WITH page AS MATERIALIZED (
    SELECT p.ref, p.outbox_id
      FROM {q_payloads} AS p
     WHERE (p.outbox_id, p.ref) > (%(after_id)s::bigint, %(after_ref)s::text)
     ORDER BY p.outbox_id, p.ref
     LIMIT %(batch)s
), last AS (
    SELECT g.outbox_id, g.ref FROM page AS g ORDER BY g.outbox_id DESC, g.ref DESC LIMIT 1
)
SELECT (SELECT l.outbox_id FROM last AS l) AS last_id,
       (SELECT l.ref FROM last AS l) AS last_ref,
       array(SELECT g.ref
               FROM page AS g
               LEFT JOIN {outbox} AS o ON o.id = g.outbox_id
              WHERE o.id IS NULL
              ORDER BY g.outbox_id, g.ref) AS gone;

-- payloads_forget --
-- Forget the objects relay prune deleted from the store, unless a row was stored for the same reference meanwhile (a row of the same event id, written since: the relay that stores it writes the object again). Each by its primary key, each row's id probed as in payloads_unneeded.
DELETE FROM {q_payloads} AS p
 USING unnest(%(refs)s::text[]) AS r(ref)
 WHERE p.ref = r.ref
   AND NOT (SELECT EXISTS (SELECT 1 FROM {outbox} AS o WHERE o.id = p.outbox_id));
