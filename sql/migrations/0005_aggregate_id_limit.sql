-- 0005: a documented limit on the length of ordered aggregate ids, enforced at the
-- producer's INSERT with an error that names it.
--
-- The relay indexes an ordered row's aggregate_id (the heads table's primary key, the
-- unique (aggregate_id, aggregate_seq) index, at most one in flight per aggregate). A
-- btree entry holds at most about 2,700 bytes, so a longer id, unless it compresses well,
-- fails with "index row size exceeds btree version 4 maximum" when the ingest numbers it,
-- inside the relay's claim transaction. 2,048 bytes leaves room for the entry's other
-- columns and headers in every one of those indexes.
--
-- The check applies to ordered rows not yet numbered: every row a producer inserts. The
-- ingest numbers a row in the very UPDATE that is checked, so it always passes, and the
-- relay's later updates see numbered rows. Rows that exist before this migration, long or
-- not, therefore never make one of the relay's own statements fail (an UPDATE by hand of
-- such a row before it is numbered does, naming the constraint). NOT VALID for the same
-- reason, and so that the existing rows are not scanned under a lock; a NOT VALID check
-- still holds for every insert from now on. Unordered rows are not indexed by
-- aggregate_id and keep any length.

ALTER TABLE {outbox} ADD CONSTRAINT {n_aggregate_id_length}
    CHECK (NOT ordered OR aggregate_seq IS NOT NULL OR octet_length(aggregate_id) <= 2048) NOT VALID;

COMMENT ON CONSTRAINT {n_aggregate_id_length} ON {outbox} IS
    'an ordered row''s aggregate_id is at most 2048 bytes (octet_length): the relay indexes it (outbox-relay README, "Data from producers")';
