-- 0010: producers' own headers.
--
-- An optional JSON object of string values a producer may insert with its event (tenant,
-- schema version, correlation id, W3C trace context). Each key reaches the broker as an
-- AMQP header or an SQS/SNS message attribute beside the relay's own; the relay checks it
-- when it claims the row, and a row whose headers it refuses goes to dead alone with the
-- reason in last_error (relay.message.producer_headers). Nullable, with no default: adding
-- it rewrites nothing, and a producer that never writes it pays nothing.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS headers jsonb;
