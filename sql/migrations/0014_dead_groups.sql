-- 0014: dead messages grouped by their error in SQL, so `relay dead list --group` and the
-- console count a million dead rows without reading them.
--
-- <table>_fingerprint(error) is the error's first line with what varies per message
-- replaced: quoted values by '?' or "?" (a quote opens only where a word does not go on:
-- the apostrophe of "producer's" is a letter, and the words after it are kept), UUIDs by
-- <uuid>, hexadecimal ids by <hex>, numbers by <n>, runs of white space by one space; at
-- most 160 characters, and '(no error recorded)' for none. PostgreSQL's regular
-- expressions run in time linear in the text; the first 2,000 characters of the line are
-- read.
CREATE FUNCTION {q_fingerprint}(error text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN error IS NULL OR btrim(error) = '' THEN '(no error recorded)'
        ELSE left(btrim(
            regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
                left(split_part(btrim(error), E'\n', 1), 2000),
                $r$(?<![[:alnum:]_])'(?:[^'\\]|\\.)*'$r$, $s$'?'$s$, 'g'),
                $r$"(?:[^"\\]|\\.)*"$r$, '"?"', 'g'),
                $r$\m[0-9a-f]{{8}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{4}}-[0-9a-f]{{12}}\M$r$, '<uuid>', 'gi'),
                $r$\m0x[0-9a-f]+\M$r$, '<hex>', 'gi'),
                $r$\m(?=[0-9a-f]*[0-9])[0-9a-f]{{8,}}\M$r$, '<hex>', 'gi'),
                $r$[0-9]+(?:\.[0-9]+)?$r$, '<n>', 'g'),
                $r$\s+$r$, ' ', 'g')), 160)
    END
$$;

-- The group of an error: 64 bits of its fingerprint's MD5, shown as 16 hex digits
-- (`relay dead retry --group KEY`).
CREATE FUNCTION {q_dead_group}(error text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ('x' || left(md5({q_fingerprint}(error)), 16))::bit(64)::bigint
$$;

-- Written when a row becomes dead (or its error changes while dead), by whatever makes it
-- so: the relay's finalize, the reaper, a hand-written UPDATE. Other rows keep what they
-- had; every reader looks at dead rows only.
ALTER TABLE {outbox} ADD COLUMN dead_group bigint;

CREATE FUNCTION {q_group_dead}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    NEW.dead_group := {q_dead_group}(NEW.last_error);
    RETURN NEW;
END
$$;

-- Only updates that make a row dead run the function: the WHEN clause is all that other
-- updates (every claim and finalize) pay.
CREATE TRIGGER {n_group_dead} BEFORE UPDATE OF status, last_error ON {outbox}
    FOR EACH ROW
    WHEN (NEW.status = 'dead' AND (OLD.status IS DISTINCT FROM 'dead' OR OLD.last_error IS DISTINCT FROM NEW.last_error))
    EXECUTE FUNCTION {q_group_dead}();
CREATE TRIGGER {n_group_dead_ins} BEFORE INSERT ON {outbox}
    FOR EACH ROW WHEN (NEW.status = 'dead') EXECUTE FUNCTION {q_group_dead}();

UPDATE {outbox} SET dead_group = {q_dead_group}(last_error) WHERE status = 'dead';

-- Groups counted and paged from the index alone; a group's rows in id order.
CREATE INDEX {n_dead_group_idx} ON {outbox} (dead_group, id) WHERE status = 'dead';
-- The console's overview counts the dead messages of each event type it lists; relay
-- status finds the dead rows that block an aggregate (only ordered ones can) without
-- reading a million unordered dead rows.
CREATE INDEX {n_dead_type_idx} ON {outbox} (event_type) WHERE status = 'dead';
CREATE INDEX {n_dead_ordered_idx} ON {outbox} (aggregate_id) WHERE status = 'dead' AND ordered;
