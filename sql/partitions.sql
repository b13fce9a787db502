-- The statements of a partitioned outbox (relay.db.partitions, the one module that names them):
-- creating one, keeping partitions ahead of the producers, and dropping finished ones.
-- Placeholders as in queries.sql (the statements on one partition, which take a {partition}
-- as well, are in partition_ddl.sql). Values are always bound parameters; DDL takes none, so
-- the few numbers DDL needs are rendered by psycopg.sql.Literal.

-- partition_kind --
-- Whether the outbox is partitioned (pg_class.relkind 'p': readable by every role, unlike <table>_partitioning) and whether this session's role may act as its owner (detach and drop partitions).
SELECT c.relkind = 'p' AS partitioned, pg_has_role(c.relowner, 'USAGE') AS owner
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(table)s;

-- partition_keep_ahead --
-- Create the partitions the outbox lacks, up to <table>_partitioning.ahead beyond the one the next id (by time: now) goes to (SECURITY DEFINER: the relays' role calls it); idempotent, one caller at a time.
SELECT partitioned, created, next_id, covered_to, covered_until FROM {q_keep_ahead}();

-- partition_config --
-- How the outbox is partitioned (no row: it is not), as the owner reads it.
SELECT key, size, span, ahead FROM {q_partitioning};

-- partition_config_write --
-- Record that the outbox is partitioned by %(key)s (id: %(size)s ids per partition; time: created_at, %(span)s per partition); a later relay migrate may change how many partitions are kept ahead, never the key, size or span.
INSERT INTO {q_partitioning} AS p (key, size, span, ahead) VALUES (%(key)s, %(size)s, %(span)s, %(ahead)s)
ON CONFLICT (singleton) DO UPDATE SET ahead = excluded.ahead;

-- partition_convert_lock --
-- The plain outbox locked against every reader and writer until the conversion commits.
LOCK TABLE {outbox} IN ACCESS EXCLUSIVE MODE;

-- partition_convert_state --
-- Under the lock: whether the plain outbox holds a row (only an empty one is converted), its commit order mode, and the last id its identity handed out (the partitioned one goes on after it, so no id is handed out twice: heads, epochs and consumers remember ids).
SELECT EXISTS (SELECT 1 FROM {outbox}) AS has_rows,
       (SELECT s.commit_order FROM {q_settings} AS s) AS commit_order,
       pg_sequence_last_value(pg_get_serial_sequence('{outbox}', 'id')::regclass) AS last_id;

-- partition_convert_grants --
-- The privileges other roles hold on the plain outbox, table-wide and per column (the producers' INSERT and SELECT (id)), to grant again on the partitioned one.
SELECT pg_get_userbyid(a.grantee) AS grantee, a.grantee = 0 AS public, a.privilege_type, a.is_grantable,
       NULL::text AS column_name
  FROM pg_class AS c, aclexplode(c.relacl) AS a
 WHERE c.oid = '{outbox}'::regclass AND a.grantee <> c.relowner
UNION ALL
SELECT pg_get_userbyid(a.grantee), a.grantee = 0, a.privilege_type, a.is_grantable, att.attname::text
  FROM pg_class AS c
  JOIN pg_attribute AS att ON att.attrelid = c.oid AND att.attnum > 0 AND NOT att.attisdropped,
       aclexplode(att.attacl) AS a
 WHERE c.oid = '{outbox}'::regclass AND a.grantee <> c.relowner
 ORDER BY 1, 5 NULLS FIRST, 3;

-- partition_convert_table --
-- The partitioned outbox in place of the empty plain one: the same columns, defaults, checks (with their comments) and identity, copied from the plain table (so the definition in sql/schema.sql stays the one source), then the plain table dropped. Its identity sequence is renamed to the plain one's name after this.
ALTER TABLE {outbox} RENAME TO {n_unpartitioned};
CREATE TABLE {outbox} (LIKE {q_unpartitioned}
    INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY INCLUDING COMMENTS
    INCLUDING STORAGE INCLUDING COMPRESSION)
    PARTITION BY RANGE (id);
DROP TABLE {q_unpartitioned};
ALTER TABLE {outbox} ADD CONSTRAINT {n_pkey} PRIMARY KEY (id);

-- partition_convert_table_time --
-- The partitioned outbox in place of the empty plain one as partition_convert_table makes it, but by created_at: a primary key on a partitioned table must hold the partition key, so it is (id, created_at) (ids stay unique by the identity; finalize and claim look rows up by id alone, in every partition).
ALTER TABLE {outbox} RENAME TO {n_unpartitioned};
CREATE TABLE {outbox} (LIKE {q_unpartitioned}
    INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY INCLUDING COMMENTS
    INCLUDING STORAGE INCLUDING COMPRESSION)
    PARTITION BY RANGE (created_at);
DROP TABLE {q_unpartitioned};
ALTER TABLE {outbox} ADD CONSTRAINT {n_pkey} PRIMARY KEY (id, created_at);

-- partition_convert_sequence --
-- The partitioned outbox's identity sequence, named by PostgreSQL while the plain one's still existed.
SELECT c.relname::text AS name
  FROM pg_class AS c
 WHERE c.oid = pg_get_serial_sequence('{outbox}', 'id')::regclass;

-- partition_convert_objects --
-- The plain outbox's indexes and triggers on the partitioned one, each under the same name and doing the same (sql/schema.sql says why each is there; tests/test_partitions.py holds the two tables' catalogs equal), but for the two unique indexes on aggregate_id, which a partitioned table cannot have without the partition key: <table>_keep_ahead creates them on each partition (<partition>_in_flight, <partition>_seq). Created on the partitioned table, each index is built on every partition attached later.
CREATE INDEX {n_leased_idx} ON {outbox} (lease_until) WHERE status = 'processing';
CREATE INDEX {n_unordered_ready_idx} ON {outbox} (available_at, id) WHERE status = 'pending' AND NOT ordered;
CREATE INDEX {n_dead_idx} ON {outbox} (id) WHERE status = 'dead';
CREATE INDEX {n_fresh_idx} ON {outbox} (xid, id)
    WHERE ordered AND aggregate_seq IS NULL AND status IN ('pending', 'dead');
CREATE INDEX {n_dead_group_idx} ON {outbox} (dead_group, id) WHERE status = 'dead';
CREATE INDEX {n_dead_type_idx} ON {outbox} (event_type) WHERE status = 'dead';
CREATE INDEX {n_dead_ordered_idx} ON {outbox} (aggregate_id) WHERE status = 'dead' AND ordered;
CREATE TRIGGER {n_route} BEFORE INSERT ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {q_route}();
CREATE TRIGGER {n_measure} BEFORE UPDATE OF payload ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {q_measure}();
CREATE CONSTRAINT TRIGGER {n_stamp} AFTER INSERT ON {outbox}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordered)
    EXECUTE FUNCTION {q_stamp}();
CREATE TRIGGER {n_follow_heads_upd} AFTER UPDATE ON {outbox}
    REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();
CREATE TRIGGER {n_follow_heads_del} AFTER DELETE ON {outbox}
    REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();
CREATE TRIGGER {n_group_dead} BEFORE UPDATE OF status, last_error ON {outbox}
    FOR EACH ROW
    WHEN (NEW.status = 'dead' AND (OLD.status IS DISTINCT FROM 'dead' OR OLD.last_error IS DISTINCT FROM NEW.last_error))
    EXECUTE FUNCTION {q_group_dead}();
CREATE TRIGGER {n_group_dead_ins} BEFORE INSERT ON {outbox}
    FOR EACH ROW WHEN (NEW.status = 'dead') EXECUTE FUNCTION {q_group_dead}();

-- partition_convert_commit_order_id --
-- Under --commit-order id (relay.db.commit_order): the fresh index on (id) alone, and no commit stamps.
DROP INDEX {q_fresh_idx};
CREATE INDEX {n_fresh_idx} ON {outbox} (id)
    WHERE ordered AND aggregate_seq IS NULL AND status IN ('pending', 'dead');
ALTER TABLE {outbox} DISABLE TRIGGER {n_stamp};

-- partition_list --
-- The outbox's partitions in id order, with their bounds ([lo, hi)) and whether a DETACH ... CONCURRENTLY of theirs was interrupted (it is finished first); and the last id the identity handed out (NULL before the first insert).
SELECT c.relname::text AS name, b.lo, b.hi, i.inhdetachpending AS detaching,
       pg_sequence_last_value(pg_get_serial_sequence('{outbox}', 'id')::regclass) AS last_id
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
 CROSS JOIN LATERAL (
        SELECT m[1]::bigint AS lo, m[2]::bigint AS hi
          FROM regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''?(-?[0-9]+)''?\) TO \(''?(-?[0-9]+)''?\)') AS m
       ) AS b
 WHERE i.inhparent = '{outbox}'::regclass
 ORDER BY b.lo;

-- partition_list_time --
-- The outbox's partitions by created_at, in time order, with their bounds ([lo, hi), rendered by the server in this session's time zone and read back by it) and whether a DETACH ... CONCURRENTLY was interrupted; the last id handed out, and now() (the partition holding it, and those after, are where producers write).
SELECT c.relname::text AS name, b.lo, b.hi, i.inhdetachpending AS detaching,
       pg_sequence_last_value(pg_get_serial_sequence('{outbox}', 'id')::regclass) AS last_id, now() AS now
  FROM pg_inherits AS i
  JOIN pg_class AS c ON c.oid = i.inhrelid
 CROSS JOIN LATERAL (
        SELECT m[1]::timestamptz AS lo, m[2]::timestamptz AS hi
          FROM regexp_match(pg_get_expr(c.relpartbound, c.oid), 'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m
       ) AS b
 WHERE i.inhparent = '{outbox}'::regclass
 ORDER BY b.lo;

-- partition_orphans --
-- Partitions of this outbox that an interrupted prune left detached and not dropped: tables of the schema named <table>_p<digits>, attached to nothing.
SELECT c.relname::text AS name, substr(c.relname, length(%(table)s) + 3)::bigint AS number
  FROM pg_class AS c
  JOIN pg_namespace AS n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relkind = 'r' AND NOT c.relispartition
   AND c.relname ~ ('^' || %(table)s || '_p[0-9]+$')
 ORDER BY c.relname;

-- partition_heads --
-- Heads rows whose head (the aggregate's earliest unfinished ordered row) is in one of the given id ranges, counted per range: a partition holding a head is kept whatever its rows say. One scan of the heads table for all of them.
SELECT r.lo, count(h.aggregate_id) AS heads
  FROM unnest(%(los)s::bigint[], %(his)s::bigint[]) AS r(lo, hi)
  JOIN {q_heads} AS h ON h.head_id >= r.lo AND h.head_id < r.hi
 GROUP BY r.lo;

-- partition_heads_time --
-- The same for partitions by created_at: heads rows whose head row was created in one of the given ranges, counted per range (each head looked up by id).
SELECT r.lo, count(*) AS heads
  FROM {q_heads} AS h
  JOIN {outbox} AS o ON o.id = h.head_id
  JOIN unnest(%(los)s::timestamptz[], %(his)s::timestamptz[]) AS r(lo, hi) ON o.created_at >= r.lo AND o.created_at < r.hi
 GROUP BY r.lo;

-- partition_rows --
-- What keeps one partition of the outbox, by the history rule of relay prune (relay.retention): unfinished rows (pending, processing; dead unless include_dead lets an unordered one created before the cutoff go; a dead ordered row always blocks its aggregate), and done rows finished after the cutoff; each counted with its first and last id. The partition is ids [lo_id, hi_id) and created_at [lo_at, hi_at): one pair its bounds, the other unbounded (the smallest and largest bigint, -infinity and infinity), so that one scan of that partition alone reads it whichever way the outbox is partitioned.
SELECT count(*) AS rows,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE status = 'pending') AS pending,
       min(id) FILTER (WHERE status = 'pending') AS pending_from,
       max(id) FILTER (WHERE status = 'pending') AS pending_to,
       count(*) FILTER (WHERE status = 'processing') AS processing,
       min(id) FILTER (WHERE status = 'processing') AS processing_from,
       max(id) FILTER (WHERE status = 'processing') AS processing_to,
       count(*) FILTER (WHERE status = 'dead' AND (ordered OR NOT %(include_dead)s OR created_at >= %(cutoff)s)) AS blocking,
       min(id) FILTER (WHERE status = 'dead' AND (ordered OR NOT %(include_dead)s OR created_at >= %(cutoff)s)) AS blocking_from,
       max(id) FILTER (WHERE status = 'dead' AND (ordered OR NOT %(include_dead)s OR created_at >= %(cutoff)s)) AS blocking_to,
       count(*) FILTER (WHERE status = 'done' AND done_at >= %(cutoff)s) AS recent,
       min(id) FILTER (WHERE status = 'done' AND done_at >= %(cutoff)s) AS recent_from,
       max(id) FILTER (WHERE status = 'done' AND done_at >= %(cutoff)s) AS recent_to,
       coalesce(bool_or(created_at >= %(cutoff)s), false) AS newer
  FROM {outbox}
 WHERE id >= %(lo_id)s::bigint AND id < %(hi_id)s::bigint
   AND created_at >= %(lo_at)s::timestamptz AND created_at < %(hi_at)s::timestamptz;

-- partition_prune_turn --
-- One relay prune at a time drops partitions of an outbox (a session lock, released when it is done): two would detach the same partition.
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay:drop-partitions:' || '{outbox}'::regclass::oid, 0)) AS taken;

-- partition_ingest_turn --
-- Take the ingest's turn (waiting: an ingest holds it for milliseconds) on a connection of its own, held from before a partition's DETACH ... CONCURRENTLY until it is dropped or attached again. A producer transaction that drew an id in the partition may commit meanwhile; while detached its row is invisible, and an ingest would consume the transaction's commit stamp without numbering the row, which no later turn would number in commit order. The relays' ingests skip a held turn (ingest_lock) and claim on.
SELECT 1 FROM {q_ingest} WHERE singleton FOR UPDATE;

-- partition_prune_turn_end --
-- Release the turn taken by partition_prune_turn.
SELECT pg_advisory_unlock(hashtextextended('outbox-relay:drop-partitions:' || '{outbox}'::regclass::oid, 0));
