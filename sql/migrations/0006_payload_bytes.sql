-- 0006: each row's payload size, so a claim can stop at a byte budget (relay start
-- --batch-bytes) without reading the payloads it does not take.
--
-- The size is the payload's jsonb size before compression, taken by the routing trigger
-- the producers' inserts already run: pg_column_size() of a value not yet stored reads
-- its length header, whatever the payload's size (measured: 0.2 to 0.4 us more per row
-- of a 50,000-row INSERT ... SELECT taking 9 us a row). The alternatives cost more:
-- octet_length(payload::text) in the trigger renders every payload (1.2 us a row at
-- 500 bytes, 28 ms at 10 MB); in the claim, it would detoast and render every candidate,
-- rows the claim then leaves included; and pg_column_size() of the stored value counts a
-- compressed payload by its compressed size (10 MB of repetitive JSON is stored in 115 kB).
--
-- Nullable and without a default, so adding it rewrites nothing; rows written before this
-- migration (and rows inserted with triggers off) are counted by their stored size.

ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS payload_bytes integer;

CREATE OR REPLACE FUNCTION {q_route}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    SELECT {q_is_ordered}(NEW.event_type, s.ord_names, s.unord_names, s.ord_patterns, s.unord_patterns, s.ord_default)
      INTO NEW.ordered
      FROM {q_settings} AS s;
    NEW.payload_bytes := pg_column_size(NEW.payload);
    RETURN NEW;
END
$$;

-- A payload changed by hand (an operator fixing a dead message before re-driving it) is
-- measured again. The relay's own updates never name the payload, so they skip this.
CREATE FUNCTION {q_measure}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.payload_bytes := pg_column_size(NEW.payload);
    RETURN NEW;
END
$$;

CREATE TRIGGER {n_measure} BEFORE UPDATE OF payload ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {q_measure}();
