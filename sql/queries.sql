-- Every statement the relay runs, one per `-- name --` header, with a one-line
-- description under it. relay.db.statements parses this file once; relay.db.dispatch is the only
-- module that names these queries (relay.shared_settings the settings_* ones).
-- Identifiers are filled in by relay.db.names (see migrations/0001_outbox.sql); values
-- are always bound parameters.
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

-- ingest_plans --
-- For the ingest's statements only (reset by ingest_plans_reset): no sequential scans. Every access path of the ingest is an index by design; with statistics taken while many rows waited to be numbered (a burst, a bulk load), the planner chose scans of the whole outbox, once per ingest or once per transaction.
SET LOCAL enable_seqscan = off;

-- ingest_plans_reset --
-- The planner's own choice again for the rest of the claim transaction.
SET LOCAL enable_seqscan = DEFAULT;

-- ingest_lock --
-- Take the ingest's turn: one relay numbers at a time. Returns no row when another relay holds the turn (that relay numbers what has committed); else whether anything may wait to be numbered. That answer comes from this statement's snapshot, taken before the lock: a "no" only leaves rows to the next turn, and saves the numbering statement when idle.
SELECT (SELECT c.stamp FROM {q_commits} AS c ORDER BY c.stamp LIMIT 1) IS NOT NULL
       OR EXISTS (SELECT 1
                    FROM {outbox} AS o  -- the fresh index, whatever its columns: one probe
                   WHERE o.ordered AND o.aggregate_seq IS NULL AND o.status IN ('pending', 'dead')) AS work
  FROM {q_ingest}
 WHERE singleton  -- its primary key: under ingest_plans a scan of even this one row costs as disabled
   FOR UPDATE SKIP LOCKED;

-- commit_order_read --
-- How the ingest learns commit order ('stamp' or 'id', relay.db.commit_order), read after ingest_lock: a switch holds the ingest's turn until it commits, so this statement's snapshot sees the mode the table's trigger and index are in.
SELECT commit_order FROM {q_settings};

-- ingest --
-- Number newly committed ordered rows (aggregate_seq = each aggregate's next numbers, by commit stamp, then id; OutboxStore runs a variant ordered by id alone under --commit-order id) and offer each aggregate's first one as head where none is. Only after ingest_lock, as the next statement of the same READ COMMITTED transaction: its snapshot is then taken after the previous ingest committed, so no row is numbered twice.
WITH quiet AS (
    -- This statement keeps the heads itself; the heads trigger may skip it (and the rest
    -- of the transaction: the reaper runs before the ingest, the claims move heads too).
    SELECT set_config('outbox_relay.claiming', 'on', true) AS flag
), timeline AS (
    -- This server's timeline (the first 8 hex digits of its current WAL file's name):
    -- 1 on a new cluster, one more at each promotion of a standby. A sequence numbered on
    -- another timeline than the aggregate's epoch starts a new epoch (see based).
    SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int::text AS tl
), txns AS (
    -- The oldest committed producer transactions not numbered yet. Every row of a
    -- transaction is visible together with its stamp, so each is numbered whole.
    SELECT c.stamp, c.xid
      FROM {q_commits} AS c
     ORDER BY c.stamp
     LIMIT %(transactions)s
), fresh AS (
    -- A head is ready at its available_at; a dead one (marked by hand before it was
    -- numbered) is not claimable.
    SELECT o.id, o.aggregate_id, CASE WHEN o.status = 'pending' THEN o.available_at END AS available_at,
           t.stamp, o.xid
      FROM txns AS t
      JOIN {outbox} AS o ON o.xid = t.xid
     WHERE o.ordered AND o.aggregate_seq IS NULL AND o.status IN ('pending', 'dead')
    UNION ALL
    -- Rows without a stamp (inserted with the relay's triggers off, for example under
    -- session_replication_role = replica): when no stamped transaction waits, every
    -- visible unnumbered row is one of them. Nothing tells their commit order: by
    -- transaction, then id, the order of the fresh index (ordered by id alone, the
    -- planner walked the primary key through the whole history to find none).
    (SELECT o.id, o.aggregate_id, CASE WHEN o.status = 'pending' THEN o.available_at END, NULL::bigint, o.xid
       FROM {outbox} AS o
      WHERE o.ordered AND o.aggregate_seq IS NULL AND o.status IN ('pending', 'dead')
        AND NOT EXISTS (SELECT 1 FROM txns)
      ORDER BY o.xid, o.id
      LIMIT %(transactions)s)
), ranked AS (
    SELECT f.id, f.aggregate_id, f.available_at,
           row_number() OVER (PARTITION BY f.aggregate_id ORDER BY f.stamp, f.xid, f.id) AS rn,
           count(*) OVER (PARTITION BY f.aggregate_id) AS n
      FROM fresh AS f
), based AS (
    -- Each aggregate's counter, read once per aggregate (a primary-key probe) and spread
    -- over its rows by the window: no join, whose plan could grow with rows x aggregates.
    SELECT r.id, r.aggregate_id, r.available_at, r.rn, r.n,
           max(CASE WHEN r.rn = 1
                    THEN coalesce((SELECT h.last_seq FROM {q_heads} AS h WHERE h.aggregate_id = r.aggregate_id), 0)
               END) OVER (PARTITION BY r.aggregate_id) AS base,
           max(CASE WHEN r.rn = 1
                    THEN (SELECT h.epoch FROM {q_heads} AS h WHERE h.aggregate_id = r.aggregate_id)
               END) OVER (PARTITION BY r.aggregate_id) AS head_epoch,
           max(CASE WHEN r.rn = 1
                    THEN (SELECT h.last_id FROM {q_heads} AS h WHERE h.aggregate_id = r.aggregate_id)
               END) OVER (PARTITION BY r.aggregate_id) AS head_last_id,
           min(r.id) OVER (PARTITION BY r.aggregate_id) AS first_id,
           max(r.id) OVER (PARTITION BY r.aggregate_id) AS last_id
      FROM ranked AS r
), opening AS (
    -- Each row with whether its aggregate opens a new epoch in this turn: it has no heads
    -- row (new, or forgotten by relay prune --heads-idle-for: numbering starts at 1 again),
    -- or its epoch was opened on another timeline (after a promotion the new primary
    -- numbers again from what was replicated, so numbers a consumer saw from transactions
    -- the failover lost come again). Those aggregates rank first, 1..n.
    SELECT b.*, t.tl, o.opens,
           dense_rank() OVER (ORDER BY o.opens DESC, b.aggregate_id) AS k
      FROM based AS b, timeline AS t,
           LATERAL (SELECT split_part(b.head_epoch, '.', 1) IS DISTINCT FROM t.tl AS opens) AS o
), counter AS (
    -- The epoch counter (0017), in the ingest turn's own row: ingest_lock holds that row
    -- until this transaction ends, so ingests take their values one after another, and a
    -- committed value is never handed out again on this timeline (a rolled-back turn
    -- numbered nothing anyone saw). An epoch opened later has a larger token; the inbox
    -- orders two epochs of one timeline by it. Not now(): the transaction's start, and one
    -- that started first can take the turn later (and clocks step back). Not a sequence:
    -- as orderly, but every relay role would need a new grant to call nextval.
    -- By its primary key (WHERE g.singleton): a scan of the table, one row though it is,
    -- costs as disabled under ingest_plans, and that cost alone made a session with JIT on
    -- compile the whole statement (0.8 s of a 1 ms ingest).
    UPDATE {q_ingest} AS g
       SET epochs = g.epochs + n.opened
      FROM (SELECT count(DISTINCT p.aggregate_id) AS opened FROM opening AS p WHERE p.opens) AS n
     WHERE g.singleton AND n.opened > 0
    RETURNING g.epochs - n.opened AS before
), epoched AS (
    -- The aggregate's epoch (0015), '<timeline>.<first seq>.n<counter>' (before 0017 the
    -- token was 8 random hex digits): the head's while it was opened on this timeline, else
    -- a new one. Consumers tell a number used again from a duplicate by it, and an old
    -- epoch from a new one (relay.inbox).
    SELECT p.id, p.aggregate_id, p.available_at, p.rn, p.n, p.base, p.head_last_id, p.first_id, p.last_id,
           CASE WHEN p.opens THEN p.tl || '.' || (p.base + 1) || '.n' || ((SELECT c.before FROM counter AS c) + p.k)
                ELSE p.head_epoch
           END AS epoch
      FROM opening AS p
), numbered AS (
    -- Driven by arrays, not by a join with the CTE: the planner then probes the primary
    -- key once per row. (Joined, it estimated a few dozen rows and rescanned the CTE for
    -- every row it updated: 7.5 s for 5,000 rows.)
    UPDATE {outbox} AS o
       SET aggregate_seq = f.seq,
           aggregate_epoch = f.epoch
      FROM quiet,
           unnest((SELECT array_agg(b.id ORDER BY b.id) FROM epoched AS b),
                  (SELECT array_agg(b.base + b.rn ORDER BY b.id) FROM epoched AS b),
                  (SELECT array_agg(b.epoch ORDER BY b.id) FROM epoched AS b)) AS f(id, seq, epoch)
     WHERE o.id = f.id
       -- On the row's latest version: a row changed meanwhile is left out, and counted.
       AND o.status IN ('pending', 'dead')
       AND o.aggregate_seq IS NULL
    RETURNING o.id
), offered AS (
    -- In aggregate order, like the heads trigger, so the two never deadlock. The counter
    -- never moves backwards (greatest), and a head that exists is left alone.
    INSERT INTO {q_heads} AS h (aggregate_id, head_id, ready_at, last_seq, epoch, last_id)
    SELECT b.aggregate_id, b.id, b.available_at, b.base + b.n, b.epoch, b.last_id
      FROM epoched AS b
     WHERE b.rn = 1
     ORDER BY b.aggregate_id
    ON CONFLICT (aggregate_id) DO UPDATE
       SET last_seq    = greatest(h.last_seq, excluded.last_seq),
           last_id     = greatest(h.last_id, excluded.last_id),
           epoch       = excluded.epoch,
           numbered_at = excluded.numbered_at,  -- now(): relay prune --heads-idle-for counts from it
           head_id     = coalesce(h.head_id, excluded.head_id),
           ready_at    = CASE WHEN h.head_id IS NULL THEN excluded.ready_at ELSE h.ready_at END
    RETURNING 1
), consumed AS (
    -- By primary key: during a backlog the table holds many more than this turn takes.
    DELETE FROM {q_commits} AS c
     WHERE c.stamp = ANY (ARRAY(SELECT t.stamp FROM txns AS t))
    RETURNING 1
)
SELECT (SELECT count(*) FROM based) AS planned,
       (SELECT count(*) FROM numbered) AS numbered,
       (SELECT count(*) FROM consumed) AS transactions,
       (SELECT count(*) FROM offered) AS aggregates,
       -- Aggregates whose new rows include an id smaller than one numbered before: a row
       -- committed after a later id of its aggregate. Only --commit-order id reports them
       -- (under 'stamp' that is any unlocked producer's normal case); the first few, as
       -- 'aggregate: id < id'.
       (SELECT array_agg(l.line)
          FROM (SELECT b.aggregate_id || ': ' || b.first_id || ' < ' || b.head_last_id AS line
                  FROM epoched AS b
                 WHERE b.rn = 1 AND b.first_id < b.head_last_id
                 ORDER BY b.aggregate_id
                 LIMIT 5) AS l) AS late;

-- claim --
-- Lease a batch: ready heads of ordered aggregates (the earliest unfinished ordered row of each, never a row behind a pending, processing or dead one) and ready rows of unordered types (plain SKIP LOCKED), the oldest ready first whichever way they come, while their payloads fit the byte budget. With oversize, the first row is taken whatever its size; without, rows over the budget are passed over (another worker of the process holds one already). One statement: on its own (autocommit) it is one round trip and atomic.
WITH heads AS (
    SELECT h.aggregate_id, h.head_id AS id, h.ready_at AS ready, s.bytes
      FROM {q_heads} AS h,
           -- A probe of the head's row (a head whose row is not pending, which should not
           -- happen, costs nothing and is held as before; its row is not claimed below).
           LATERAL (SELECT coalesce((SELECT coalesce(o.payload_bytes, pg_column_size(o.payload))
                                       FROM {outbox} AS o
                                      WHERE o.id = h.head_id AND o.status = 'pending'), 0) AS bytes) AS s
     WHERE h.ready_at <= now()
       AND (%(oversize)s OR s.bytes <= %(budget)s)
     ORDER BY h.ready_at
     LIMIT %(batch)s
       FOR UPDATE OF h SKIP LOCKED
), plain AS (
    SELECT o.id, o.available_at AS ready, s.bytes
      FROM {outbox} AS o,
           -- Measured by the insert trigger; rows written before 0006, or with triggers
           -- off, by their stored size (read without detoasting: a compressed payload
           -- counts only its compressed size).
           LATERAL (SELECT coalesce(o.payload_bytes, pg_column_size(o.payload)) AS bytes) AS s
     WHERE o.status = 'pending'
       AND NOT o.ordered
       AND o.available_at <= now()
       AND (%(oversize)s OR s.bytes <= %(budget)s)
     ORDER BY o.available_at, o.id
     LIMIT %(batch)s
       FOR UPDATE OF o SKIP LOCKED
), picked AS (
    -- Both kinds in one line by readiness, so that neither waits behind the other; a row
    -- locked above and not picked is free again when this statement ends.
    SELECT c.aggregate_id, c.id, c.bytes
      FROM (SELECT c.aggregate_id, c.id, c.bytes,
                   sum(c.bytes) OVER (ORDER BY c.ready, c.id ROWS UNBOUNDED PRECEDING) AS running,
                   row_number() OVER (ORDER BY c.ready, c.id) AS n
              FROM (SELECT aggregate_id, id, ready, bytes FROM heads
                    UNION ALL
                    SELECT NULL, id, ready, bytes FROM plain) AS c) AS c
     WHERE c.n <= %(batch)s
       AND (c.running <= %(budget)s OR (c.n = 1 AND %(oversize)s))
), held AS (
    -- An array, not a join: the planner then probes the primary key for each picked head
    -- instead of hashing the whole heads table (10,000 blocked aggregates made it do that).
    UPDATE {q_heads} AS h
       SET ready_at = NULL
     WHERE h.aggregate_id = ANY (ARRAY(SELECT aggregate_id FROM picked WHERE aggregate_id IS NOT NULL))
), quiet AS (
    -- The heads are leased right here, so the heads trigger may skip this transaction's
    -- statements from here on (the reaper, when it runs, ran before this with it on).
    SELECT set_config('outbox_relay.claiming', 'on', true) AS flag
)
UPDATE {outbox} AS o
   SET status        = 'processing',
       lease_owner   = %(owner)s,
       lease_until   = now() + %(lease)s,
       lease_version = o.lease_version + 1,
       attempts      = o.attempts + 1
  FROM picked, quiet
 WHERE o.id = picked.id
   AND o.status = 'pending'
-- A payload over the budget is left to payload_of, on a connection of its own (see OutboxStore.claim).
-- event_id as text: the message carries it as a string, and text is the cheapest to read.
RETURNING o.id, o.aggregate_type, o.aggregate_id, o.event_type,
          CASE WHEN picked.bytes <= %(budget)s THEN o.payload END AS payload,
          o.attempts, o.lease_version, extract(epoch FROM now() - o.created_at)::float8 AS age_s,
          o.ordered, o.aggregate_seq, picked.bytes, o.headers,
          {q_event_id}(o.event_id, o.id, o.xid, o.created_at)::text AS event_id, o.aggregate_epoch, o.created_at;

-- payload_of --
-- The payload of one claimed row that was over the byte budget, while the lease is still ours.
SELECT o.payload
  FROM {outbox} AS o
 WHERE o.id = %(id)s
   AND o.status = 'processing'
   AND o.lease_version = %(lease_version)s;

-- payload_spool_table --
-- A claimed payload over the claim-check's threshold is copied into a temporary table of a session of its own (dropped with the transaction), as UTF-8 bytes kept uncompressed, and read from there a slice at a time (payload_spool_slice): libpq holds a whole result row in memory, and a slice of an uncompressed stored value reads only its own TOAST chunks, so the relay holds one slice of the payload at a time.
CREATE TEMPORARY TABLE relay_spool (b bytea) ON COMMIT DROP;

-- payload_spool_external --
-- Kept uncompressed (see payload_spool_table): slices of a compressed value would each decompress it from its start.
ALTER TABLE relay_spool ALTER COLUMN b SET STORAGE EXTERNAL;

-- payload_spool --
-- The payload of one claimed row, as the claim's text (the jsonb rendered, in UTF-8), while the lease is still ours.
INSERT INTO relay_spool (b)
SELECT convert_to(o.payload::text, 'UTF8')
  FROM {outbox} AS o
 WHERE o.id = %(id)s
   AND o.status = 'processing'
   AND o.lease_version = %(lease_version)s;

-- payload_spool_slice --
-- The next %(n)s bytes of the spooled payload from byte %(at)s (1-based).
SELECT substring(b FROM %(at)s FOR %(n)s) FROM relay_spool;

-- listener_turn --
-- Take the settings row's lock before writing this relay process's row in <table>_listeners: every relay that changes its row then recomputes the producers' answer (listener_answer) in the next statement, on a snapshot taken after the previous relay's change committed, so two relays changing state at once cannot leave a stale answer.
SELECT 1 FROM {q_settings} FOR UPDATE;

-- listener_set --
-- Record whether this relay process is idle (every worker found nothing and waits for a wake-up) or working, valid for %(ttl)s by the database clock. After listener_turn; listener_answer follows.
INSERT INTO {q_listeners} AS l (owner, idle, expires_at)
VALUES (%(owner)s, %(idle)s, now() + %(ttl)s)
ON CONFLICT (owner) DO UPDATE
   SET idle = excluded.idle, expires_at = excluded.expires_at;

-- listener_drop --
-- Remove this relay process's row (it stops, or lost its LISTEN connection): it is no longer there to be woken, and no longer working. After listener_turn; listener_answer follows.
DELETE FROM {q_listeners} WHERE owner = %(owner)s;

-- listener_sweep --
-- Remove rows that expired a while ago (relay processes that were killed), so the table holds live relays only. After listener_turn; listener_answer follows.
DELETE FROM {q_listeners} WHERE expires_at < now() - interval '1 minute';

-- listener_answer --
-- The producers' answer, read by their insert trigger from the settings row (migration 0008): notify until wake_until, which is the earliest expiry of the live rows while every one of them is idle, and NULL (do not notify) while one works or none is live.
UPDATE {q_settings}
   SET wake_until = (SELECT CASE WHEN bool_and(l.idle) THEN min(l.expires_at) END
                       FROM {q_listeners} AS l
                      WHERE l.expires_at > now());

-- settings_read --
-- The outbox's shared settings (ordering map, wake-ups), which relay start runs by and relay status and relay settings show print.
SELECT ord_default, ord_names, unord_names, ord_patterns, unord_patterns, notify, commit_order, updated_at
  FROM {q_settings};

-- settings_lock --
-- The shared settings, locked until the transaction ends: relay settings set and relay migrate read, change and write them under this lock, so two of them cannot lose each other's change.
SELECT ord_default, ord_names, unord_names, ord_patterns, unord_patterns, notify, commit_order, updated_at
  FROM {q_settings}
   FOR UPDATE;

-- settings_write --
-- Store the shared settings (relay migrate with ordering or notify options, relay settings set; relay start never does): rows are routed by the map when inserted, and the insert trigger notifies only while notify is true. A change of commit_order is written after relay.db.commit_order.switch, in the same transaction.
UPDATE {q_settings}
   SET ord_default    = %(ord_default)s,
       ord_names      = %(ord_names)s,
       unord_names    = %(unord_names)s,
       ord_patterns   = %(ord_patterns)s,
       unord_patterns = %(unord_patterns)s,
       notify         = %(notify)s,
       commit_order   = %(commit_order)s,
       updated_at     = now()
RETURNING updated_at;

-- finalize --
-- Write a batch of outcomes in one statement, each row fenced by status = 'processing' and its lease_version; returns the ids written. lease_version is written too, with the token the writer holds: the fence makes that the value already there, and it leaves in the row (and in any audit of its updates) whose lease wrote it. Committed without waiting for its WAL flush (see the comment in the statement).
UPDATE {outbox} AS o
   SET status       = f.status,
       lease_version = f.version,
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
       AS f(id, version, status, delay_s, error, refund),
       -- This statement's transaction (autocommit: the statement alone) commits without
       -- waiting for its WAL to reach disk. Safe: a crash of the database can lose only an
       -- outcome nothing durable has built on (every claim commits synchronously, and a
       -- flush writes all WAL before it, so the claim of the aggregate's next message makes
       -- this outcome durable first); a lost outcome leaves its row processing, the lease
       -- runs out and the message is delivered again, as after a relay crash. Fencing
       -- tokens come from claims, which are never lost once used. Saves a flush (about
       -- 125 us on this project's test machine) on every batch.
       (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit
 WHERE o.id = f.id
   AND o.status = 'processing'
   AND o.lease_version = f.version
RETURNING o.id;

-- leader_take --
-- Become the one relay of this outbox that runs a duty only one should (the scheduled prune): a session-level advisory lock on the duty and the outbox, held on a connection of its own for as long as that lives; false while another relay holds it. Keys from hashtext: a collision with another lock of the cluster only makes one of the two wait.
SELECT pg_try_advisory_lock(hashtext('outbox-relay ' || %(duty)s), hashtext(%(outbox)s));

-- leader_check --
-- The leader's connection answers (and so its lock is still held).
SELECT 1;

-- payloads_record --
-- Name the objects a relay is about to store (relay.claimcheck) before it writes them, so that relay prune finds every object there is: its reference and the row it is stored for. A row of the same event id stored later takes an object over (the greater id), so the object stays while that row is in history.
INSERT INTO {q_payloads} AS p (ref, outbox_id)
SELECT r.ref, r.outbox_id
  FROM unnest(%(refs)s::text[], %(ids)s::bigint[]) AS r(ref, outbox_id)
    ON CONFLICT (ref) DO UPDATE
   SET outbox_id = greatest(p.outbox_id, excluded.outbox_id);
