-- 0019: the claim-check's objects (relay.claimcheck), named where relay prune finds them.
--
-- A relay records each object it is about to store (before it writes it, so that no object
-- exists that this table does not name), and relay prune deletes an object once the row it
-- was stored for has left history (a prune's DELETE, a dropped partition), then its row
-- here. Rows of one event id share one object (its key is derived from the event id): the
-- latest of them keeps it. Nothing else changes; `relay migrate --grant-relay` grants the
-- relays' role this table.
CREATE TABLE {q_payloads} (
    ref       text        PRIMARY KEY,             -- s3://<bucket>/<key>
    outbox_id bigint      NOT NULL,                -- the row it was stored for; kept while that row is in history
    stored_at timestamptz NOT NULL DEFAULT now()   -- when it was recorded, before the object was written
);
-- relay prune walks it in the outbox's id order: its probes of the outbox's primary key then
-- go in order too (10 s for 1,000,000 objects in reference order, which is random).
CREATE INDEX {n_payloads_row_idx} ON {q_payloads} (outbox_id, ref);
