-- 0018: an outbox may be range-partitioned by id or by created_at (`relay migrate
-- --partition-by id|time`), so that its history leaves a partition at a time (`relay prune`
-- drops partitions whose every row is finished) instead of a DELETE per row and the dead
-- tuples it leaves.
--
-- Nothing changes for a plain outbox: this adds the table that says how an outbox is
-- partitioned (empty for a plain one), the function that keeps partitions ahead of the
-- producers, and makes the two triggers that used the name of the table they fire on use
-- the outbox's (on a partitioned outbox they fire on one of its partitions).

-- One row when the outbox is partitioned (written by `relay migrate --partition-by id|time`,
-- relay.db.partitions), none when it is a plain table. Read only by <table>_keep_ahead (which
-- runs as the owner) and the owner's `relay migrate`: relays and operators tell a
-- partitioned outbox by the catalog (pg_class.relkind).
CREATE TABLE {q_partitioning} (
    singleton  boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    key        text        NOT NULL CHECK (key IN ('id', 'time')),  -- the partition key: id, or created_at
    size       bigint      CHECK (size > 0),             -- by id: <table>_pN holds ids [N * size, (N + 1) * size)
    span       interval    CHECK (span >= interval '1 hour'),  -- by time: each partition holds created_at
                                                         -- [start, start + span), starts aligned to span from the epoch
    ahead      integer     NOT NULL CHECK (ahead >= 1),  -- partitions kept beyond the one the next id (or now) goes to
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (CASE key WHEN 'id' THEN size IS NOT NULL AND span IS NULL ELSE span IS NOT NULL AND size IS NULL END)
);

-- Creates the partitions a partitioned outbox lacks: by id, the one the next id goes to and
-- `ahead` beyond it; by time, the one holding now() and `ahead` beyond it (bounds aligned to
-- the span from the epoch, in UTC, by date_bin; named <table>_pYYYYMMDD when the span is whole
-- days, <table>_pYYYYMMDDHH otherwise, so that names sort by time and fit 63 bytes with the
-- index suffixes). So a producer's INSERT always finds its partition (there is no DEFAULT
-- partition: one would hold rows no drop could take, and attaching a partition would have to
-- scan it). Idempotent, and safe when several relays (and `relay migrate`) call it at once:
-- they take turns on an advisory lock and each creates only what is still missing. Returns
-- whether the outbox is partitioned, the partitions it created, the next id, and the first id
-- (by id) or the first time (by time) with no partition yet.
--
-- SECURITY DEFINER: only the owner may create partitions, and the relays (which run it, the
-- elected one every few minutes) hold no DDL. It creates nothing but the partitions the
-- <table>_partitioning row asks for. Each partition is made as a table of its own and then
-- attached, which takes SHARE UPDATE EXCLUSIVE on the outbox (CREATE TABLE ... PARTITION OF
-- takes ACCESS EXCLUSIVE, and would queue every producer and claim behind a long query).
--
-- The two unique indexes on aggregate_id (at most one message in flight per aggregate, one
-- unfinished row per (aggregate, aggregate_seq)) cannot be built on a partitioned table
-- without the partition key, so each partition gets its own: they hold within a partition,
-- and across partitions what they only double-check is kept by the claims and the ingest
-- (one head per aggregate, locked when claimed; numbers drawn under the ingest's turn).
--
-- The outbox's name is written in quotes below as a regclass literal: names are validated
-- identifiers ([a-z_][a-z0-9_]*, relay.db.names), rendered quoted.
CREATE FUNCTION {q_keep_ahead}()
RETURNS TABLE (partitioned boolean, created text[], next_id bigint, covered_to bigint, covered_until timestamptz)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    outbox regclass := '{outbox}';
    cfg    record;
    nsp    text;
    base   text;
    cur    bigint;
    first  bigint;
    start  timestamptz;
    lo     timestamptz;
    bounds text;
    part   text;
    made   text[] := ARRAY[]::text[];
BEGIN
    SELECT p.key, p.size, p.span, p.ahead INTO cfg FROM {q_partitioning} AS p;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, made, NULL::bigint, NULL::bigint, NULL::timestamptz;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('outbox-relay:partitions:' || outbox::oid, 0));
    SELECT n.nspname, c.relname INTO nsp, base
      FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
     WHERE c.oid = outbox;
    -- The identity's last value (NULL before the first insert): ids above it are to come.
    cur := coalesce(pg_sequence_last_value(pg_get_serial_sequence(outbox::text, 'id')::regclass), 0);
    IF cfg.key = 'time' THEN
        start := date_bin(cfg.span, now(), timestamptz '1970-01-01 00:00:00+00');
        first := 0;
    ELSE
        first := (cur + 1) / cfg.size;
    END IF;
    FOR n IN first .. first + cfg.ahead LOOP
        IF cfg.key = 'time' THEN
            lo := start + n * cfg.span;
            part := base || '_p' || to_char(lo AT TIME ZONE 'UTC',
                                            CASE WHEN extract(epoch FROM cfg.span)::bigint % 86400 = 0
                                                 THEN 'YYYYMMDD' ELSE 'YYYYMMDDHH24' END);
            bounds := format('FROM (%L) TO (%L)', lo, lo + cfg.span);
        ELSE
            part := base || '_p' || lpad(n::text, 4, '0');
            bounds := format('FROM (%s) TO (%s)', n * cfg.size, (n + 1) * cfg.size);
        END IF;
        CONTINUE WHEN to_regclass(format('%I.%I', nsp, part)) IS NOT NULL;
        EXECUTE format('CREATE TABLE %I.%I (LIKE %s INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', nsp, part, outbox);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I.%I (aggregate_id) WHERE ordered AND status = ''processing''',
                       part || '_in_flight', nsp, part);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I.%I (aggregate_id, aggregate_seq)'
                       ' WHERE ordered AND status IN (''pending'', ''processing'', ''dead'') AND aggregate_seq IS NOT NULL',
                       part || '_seq', nsp, part);
        EXECUTE format('ALTER TABLE %s ATTACH PARTITION %I.%I FOR VALUES %s', outbox, nsp, part, bounds);
        made := made || part;
    END LOOP;
    IF cfg.key = 'time' THEN
        RETURN QUERY SELECT true, made, cur + 1, NULL::bigint, start + (cfg.ahead + 1) * cfg.span;
    ELSE
        RETURN QUERY SELECT true, made, cur + 1, (first + cfg.ahead + 1) * cfg.size, NULL::timestamptz;
    END IF;
END
$$;

-- Only the relays' role calls it (granted by relay migrate --grant-relay), and the owner.
REVOKE ALL ON FUNCTION {q_keep_ahead}() FROM PUBLIC;

-- The commit stamp, keyed by the outbox rather than the table the trigger fires on: on a
-- partitioned outbox that is a partition, and a transaction whose rows land in two
-- partitions must still draw one stamp. pg_partition_root is NULL for a plain table, whose
-- key stays its own oid, as before.
CREATE OR REPLACE FUNCTION {q_stamp}() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    flag text := 'outbox_relay.stamped_' || coalesce(pg_partition_root(TG_RELID)::oid, TG_RELID);
BEGIN
    IF current_setting(flag, true) = 'on' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config(flag, 'on', true);
    INSERT INTO {q_commits} (stamp, xid) VALUES (nextval('{q_commit_stamp}'), pg_current_xact_id());
    RETURN NULL;
END
$$;

-- The wake-up on the outbox's channel ("schema.table", which relays LISTEN on), also when
-- the row lands in a partition, whose own name the trigger sees. Looked up only while a
-- relay waits for a wake-up.
CREATE OR REPLACE FUNCTION {q_route}() RETURNS trigger
LANGUAGE plpgsql
AS $$
DECLARE
    wake boolean;
BEGIN
    SELECT {q_is_ordered}(NEW.event_type, s.ord_names, s.unord_names, s.ord_patterns, s.unord_patterns, s.ord_default),
           s.notify AND s.wake_until > now()
      INTO NEW.ordered, wake
      FROM {q_settings} AS s;
    NEW.payload_bytes := pg_column_size(NEW.payload);
    IF wake THEN
        PERFORM pg_notify(coalesce((SELECT n.nspname || '.' || c.relname
                                      FROM pg_catalog.pg_class AS c
                                      JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
                                     WHERE c.oid = pg_catalog.pg_partition_root(TG_RELID)),
                                   TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME), '');
    END IF;
    RETURN NEW;
END
$$;
