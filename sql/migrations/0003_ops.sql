-- 0003: what the operator tools need (relay status, explain, dead, prune); the claim and
-- finalize path is untouched.
--
-- * A partial index over dead rows, so `relay status` counts them and `relay dead` lists
--   them without reading the done history. It holds only dead rows (few); other writes pay
--   only its predicate test, and since `status` already appears in every partial index's
--   predicate, no update that could be HOT before stops being HOT.
-- * Columns recording an operator's decision about a dead message: who re-drove or skipped
--   it, when and why. Nullable and without defaults, so adding them rewrites nothing; no
--   CHECK on them either, which every claim and finalize would evaluate (only relay.deadletters
--   writes them).
--
-- IF NOT EXISTS throughout: on a table too large to index under a write lock, an operator
-- may build the index beforehand without blocking producers,
--   CREATE INDEX CONCURRENTLY outbox_dead_idx ON outbox (id) WHERE status = 'dead';
-- and this migration then only adds the columns (see docs/operations.md).

ALTER TABLE {outbox}
    ADD COLUMN IF NOT EXISTS resolution    text,         -- 'retried' or 'skipped': the last operator action
    ADD COLUMN IF NOT EXISTS resolved_by   text,         -- who took it (--by; default user@host)
    ADD COLUMN IF NOT EXISTS resolved_at   timestamptz,
    ADD COLUMN IF NOT EXISTS resolved_note text;         -- why (--reason)

CREATE INDEX IF NOT EXISTS {n_dead_idx} ON {outbox} (id) WHERE status = 'dead';
