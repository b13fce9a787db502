-- The statements on one partition of a partitioned outbox (relay.db.partitions), one per
-- `-- name --` header with a one-line description. Placeholders as in queries.sql, plus
-- {partition}: the partition, a quoted schema-qualified identifier whose name comes from the
-- catalog. Kept apart from the named statements every store renders with the outbox's names
-- alone (relay.db.statements.named_partition_ddl reads them).

-- partition_detached_rows --
-- The same, on a partition just detached and locked (ACCESS EXCLUSIVE, in the transaction that drops it): rows a producer's transaction wrote into it while it was being detached show here, and it is attached again instead of dropped.
SELECT count(*) AS rows,
       count(*) FILTER (WHERE status = 'done') AS done,
       count(*) FILTER (WHERE status = 'dead') AS dead,
       count(*) FILTER (WHERE NOT (
           (status = 'done' AND done_at < %(cutoff)s)
           OR (%(include_dead)s AND status = 'dead' AND NOT ordered AND created_at < %(cutoff)s))) AS unfinished
  FROM {partition};

-- partition_lock --
-- Take the detached partition before it is checked and dropped.
LOCK TABLE {partition} IN ACCESS EXCLUSIVE MODE;

-- partition_detach --
-- Detach a partition without blocking producers and relays (SHARE UPDATE EXCLUSIVE on the outbox; it waits for every transaction that may see the partition). Not in a transaction block.
ALTER TABLE {outbox} DETACH PARTITION {partition} CONCURRENTLY;

-- partition_detach_finalize --
-- Finish a DETACH ... CONCURRENTLY that was interrupted (the partition is left "detach pending" otherwise).
ALTER TABLE {outbox} DETACH PARTITION {partition} FINALIZE;

-- partition_drop --
-- Drop a detached partition whose every row was found finished under its lock.
DROP TABLE {partition};
