-- 0015: an identity for every event that survives a failover, and the epoch of each
-- aggregate's sequence.
--
-- After a failover with asynchronous replication the new primary hands out again the ids
-- (and aggregate_seq numbers) of the transactions it lost: a consumer that de-duplicates by
-- outbox_id then drops real new events as duplicates. event_id is random (version 4 UUID),
-- so it is never handed out twice, whatever the server. Producers leave it to its default
-- (or write their own, relay.Outbox does); the relay sends it as AMQP message_id and as the
-- event_id field or attribute. Added without a stored default for existing rows (a
-- volatile default would rewrite the table under an exclusive lock): those read NULL, and
-- <table>_event_id gives them a stable one derived from the row.
ALTER TABLE {outbox} ADD COLUMN event_id uuid;
ALTER TABLE {outbox} ALTER COLUMN event_id SET DEFAULT gen_random_uuid();

-- The event id the relay sends: the row's own, or for a row written before 0015 one
-- derived from what identifies it (the same at every delivery and replay).
CREATE FUNCTION {q_event_id}(event_id uuid, id bigint, xid xid8, created_at timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT coalesce(event_id, md5('outbox-relay/' || id || '/' || xid || '/' || extract(epoch FROM created_at))::uuid)
$$;

-- The epoch of an ordered row's number, '<timeline>.<first seq>.<token>', set by the
-- ingest beside aggregate_seq: numbers are gapless and increasing within one epoch. A new
-- epoch starts when an aggregate's counter starts again: a new aggregate, one whose heads
-- row relay prune --heads-idle-for forgot (at 1), or the first number on a new timeline
-- after a standby was promoted (at whatever the new primary had). NULL on unordered rows
-- and rows numbered before 0015.
ALTER TABLE {outbox} ADD COLUMN aggregate_epoch text;

-- The aggregate's current epoch; NULL for heads written before 0015 (the next number
-- opens one).
ALTER TABLE {q_heads} ADD COLUMN epoch text;
