-- 0016: commit order by id, for outboxes whose producers lock the aggregate.
--
-- The commit stamp (the <table>_stamp trigger) costs every producer transaction that writes
-- ordered rows a row in <table>_commits at COMMIT: about 15% of a single-row transaction's
-- rate. Producers that lock the aggregate before they insert its event (the design
-- reference's pattern: SELECT ... FOR UPDATE on the aggregate's row, or an advisory lock
-- on its id) draw each event's id under that lock, so within an aggregate id order is
-- commit order and no stamp is needed. `relay settings set --commit-order id` says so for
-- one outbox: it turns the stamp trigger off and indexes the rows waiting to be numbered
-- by id instead of by transaction (relay.db.commit_order does the switch, under locks, after
-- numbering everything committed by the old rule). 'stamp', the default, is right for any
-- producer.
ALTER TABLE {q_settings} ADD COLUMN commit_order text NOT NULL DEFAULT 'stamp';
ALTER TABLE {q_settings} ADD CONSTRAINT {n_settings_commit_order_check}
    CHECK (commit_order IN ('stamp', 'id'));

-- The largest outbox id the ingest has numbered for the aggregate: under --commit-order id,
-- a row that becomes visible with a smaller id was committed after a later id of its
-- aggregate, which a producer that locks the aggregate never does. The relay then logs a
-- warning naming the aggregate (its number was given by id, not by commit order). NULL
-- until the ingest numbers a row of the aggregate after this migration.
ALTER TABLE {q_heads} ADD COLUMN last_id bigint;

-- For later migrations: under 'id' the stamp trigger is disabled and <table>_fresh_idx is
-- on (id). A migration that recreates either must read <table>_settings.commit_order and
-- leave them as that mode has them.
