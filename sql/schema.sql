-- The schema of one outbox as an empty schema holds it after every migration (0001 to
-- 0018), in one file to read: each object in its final form, with why it is there. Objects
-- a later migration dropped are absent, functions appear in their last version, and what
-- only converted existing rows (back-fills, renumbering) is left out: there are none here.
--
-- The rule: every new migration updates this file in the same change. `relay migrate`
-- never runs it (the numbered files under sql/migrations/ are what it applies);
-- tests/test_schema_file.py applies every migration to one empty schema, loads this file
-- into another, and fails when their catalogs (tables, columns, constraints, indexes,
-- triggers, functions, sequences, comments) or the rows they ship with differ.
--
-- The migration ledger is included: <table>_migrations exists here with one row per
-- migration (at the end of the file), as `relay migrate` leaves it. So a schema loaded from
-- this file is indistinguishable from a migrated one, and `relay migrate` finds it up to
-- date and applies later migrations to it as to any other.
--
-- Loaded into a schema that already exists (relay.db.statements.schema_sql(), rendered by
-- relay.db.names.OutboxNames.render, like a migration), in one transaction. Placeholders
-- are those of the migrations, filled in with quoted identifiers:
--   {outbox}  the outbox table, schema-qualified
--   {q_X}     a schema-qualified object named "<table>_X"
--   {n_X}     an unqualified name "<table>_X" (indexes, constraints)

-- ---- The outbox

-- Producers insert aggregate_type, aggregate_id, event_type and payload (id and created_at
-- fill themselves); the other columns belong to the relay, through its statements
-- (sql/queries.sql) and the triggers below.
CREATE TABLE {outbox} (
    id             bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),

    -- Everything below belongs to the relay; producers never write it.
    status         text        NOT NULL DEFAULT 'pending',
    available_at   timestamptz NOT NULL DEFAULT now(),  -- earliest claim time (backoff, defer)
    attempts       integer     NOT NULL DEFAULT 0,      -- claims so far; a crash counts as one
    lease_owner    text,                                -- who holds the lease, for people; fencing uses lease_version
    lease_until    timestamptz,                         -- database clock; past it the row may be re-claimed
    lease_version  bigint      NOT NULL DEFAULT 0,      -- fencing token, +1 on every claim
    last_error     text,
    done_at        timestamptz,
    -- Routed when inserted (ordered or not), by the ordering map in <table>_settings, so
    -- each claim strategy has its own partial index and never walks the other's rows.
    ordered        boolean     NOT NULL DEFAULT true,
    -- The writing transaction, matched to its commit stamp in <table>_commits.
    xid            xid8        NOT NULL DEFAULT pg_current_xact_id(),
    -- An operator's decision about a dead message: who re-drove or skipped it, when and
    -- why. No CHECK on them, which every claim and finalize would evaluate (only
    -- relay.ops.deadletters writes them).
    resolution     text,         -- 'retried' or 'skipped': the last operator action
    resolved_by    text,         -- who took it (--by; default user@host)
    resolved_at    timestamptz,
    resolved_note  text,         -- why (--reason)
    -- The position of an ordered row in its aggregate's sequence, set once by the ingest;
    -- NULL until then, and always for unordered rows.
    aggregate_seq  bigint,
    -- The payload's jsonb size before compression, taken by the routing trigger, so a
    -- claim can stop at a byte budget (relay start --batch-bytes) without reading the
    -- payloads it does not take. NULL for rows inserted with triggers off, which are
    -- counted by their stored size.
    payload_bytes  integer,
    -- Producers' own headers (0010): a JSON object of string values, each sent as an AMQP
    -- header or SQS/SNS message attribute; checked when claimed (relay.message.producer_headers).
    headers        jsonb,
    -- The group of a dead row's error (0014, <table>_dead_group): written by the
    -- <table>_group_dead trigger when a row becomes dead; read only on dead rows.
    dead_group     bigint,
    -- The event's identity (0015): random, so never handed out twice, not even by a new
    -- primary after a failover that lost transactions (ids and aggregate_seq numbers can
    -- be). Producers leave it to the default or write their own (relay.Outbox). Rows
    -- written before 0015 hold NULL; the relay sends <table>_event_id's for them.
    event_id       uuid        DEFAULT gen_random_uuid(),
    -- The epoch of aggregate_seq, '<timeline>.<first seq>.<token>', set by the ingest with
    -- it: numbers are gapless within one epoch, and a new one starts where the counter
    -- starts again (new or forgotten aggregate, promoted standby). The token is 'n' and the
    -- epoch counter's value (0017: a later epoch of a timeline has a larger one; 8 random
    -- hex digits before). NULL on unordered rows.
    aggregate_epoch text,

    CONSTRAINT {n_status_check} CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    CONSTRAINT {n_attempts_check} CHECK (attempts >= 0),
    -- A lease exists exactly while the row is processing; finalize and reap clear it.
    CONSTRAINT {n_lease_check} CHECK ((status = 'processing') = (lease_until IS NOT NULL))
);

-- A documented limit on the length of ordered aggregate ids, enforced at the producer's
-- INSERT with an error that names it. The relay indexes an ordered row's aggregate_id (the
-- heads table's primary key, the unique (aggregate_id, aggregate_seq) index, at most one in
-- flight per aggregate). A btree entry holds at most about 2,700 bytes, so a longer id,
-- unless it compresses well, fails with "index row size exceeds btree version 4 maximum"
-- when the ingest numbers it, inside the relay's claim transaction. 2,048 bytes leaves room
-- for the entry's other columns and headers in every one of those indexes.
--
-- The check applies to ordered rows not yet numbered: every row a producer inserts. The
-- ingest numbers a row in the very UPDATE that is checked, so it always passes, and the
-- relay's later updates see numbered rows. Unordered rows are not indexed by aggregate_id
-- and keep any length. NOT VALID as migration 0005 adds it (there, so that rows written
-- before it are neither scanned under a lock nor refused); a NOT VALID check still holds
-- for every insert. A CHECK written inside CREATE TABLE would be marked valid, hence the
-- ALTER TABLE.
ALTER TABLE {outbox} ADD CONSTRAINT {n_aggregate_id_length}
    CHECK (NOT ordered OR aggregate_seq IS NOT NULL OR octet_length(aggregate_id) <= 2048) NOT VALID;

COMMENT ON CONSTRAINT {n_aggregate_id_length} ON {outbox} IS
    'an ordered row''s aggregate_id is at most 2048 bytes (octet_length): the relay indexes it (outbox-relay README, "Data from producers")';

-- Every index but the primary key is partial, so rows that are done (the bulk of a table
-- that keeps history) are never scanned by the claims or the operator tools.

-- Leases to expire: the reaper and the re-claim of a crashed worker's rows.
CREATE INDEX {n_leased_idx} ON {outbox} (lease_until) WHERE status = 'processing';

-- Ready unordered rows, oldest-available first.
CREATE INDEX {n_unordered_ready_idx} ON {outbox} (available_at, id) WHERE status = 'pending' AND NOT ordered;

-- At most one message in flight per ordered aggregate, whatever any claim query does:
-- a second ordered row of an aggregate cannot become 'processing' while one is.
CREATE UNIQUE INDEX {n_one_in_flight_idx} ON {outbox} (aggregate_id) WHERE ordered AND status = 'processing';

-- Dead rows, so `relay status` counts them and `relay dead` lists them without reading
-- the done history. It holds only dead rows (few); other writes pay only its predicate
-- test, and since `status` appears in every other partial index's predicate, it makes no
-- update that could be HOT stop being HOT.
CREATE INDEX {n_dead_idx} ON {outbox} (id) WHERE status = 'dead';

-- New ordered rows the ingest has not numbered yet, found by their transaction. Dead too:
-- a row someone marked dead by hand before it was numbered still takes its place in the
-- sequence, and blocks its aggregate there. Under --commit-order id (0016) the same index is
-- on (id) alone: the ingest takes those rows in id order (relay.db.commit_order rebuilds it).
CREATE INDEX {n_fresh_idx} ON {outbox} (xid, id)
    WHERE ordered AND aggregate_seq IS NULL AND status IN ('pending', 'dead');

-- "The next unfinished ordered row of this aggregate", for advancing a head. Unique: two
-- unfinished rows of one aggregate can never share a number. Numbered rows only, so a
-- producer's insert does not write this index.
CREATE UNIQUE INDEX {n_aggregate_seq_idx} ON {outbox} (aggregate_id, aggregate_seq)
    WHERE ordered AND status IN ('pending', 'processing', 'dead') AND aggregate_seq IS NOT NULL;

-- ---- Routing: the ordering map, and the wake-up of idle relays

-- The ordering map evaluated in the database, so the claims can route rows by event
-- type. Twin of relay.ordering.OrderingMap.is_ordered; a property test keeps them equal.
CREATE FUNCTION {q_is_ordered}(
    event_type     text,
    ord_names      text[],
    unord_names    text[],
    ord_patterns   text[],
    unord_patterns text[],
    ord_default    boolean
) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN event_type = ANY (ord_names)      THEN true
        WHEN event_type = ANY (unord_names)    THEN false
        WHEN event_type ~ ANY (ord_patterns)   THEN true
        WHEN event_type ~ ANY (unord_patterns) THEN false
        ELSE ord_default
    END
$$;

-- The settings every relay of this outbox shares (relay start and `relay settings set`
-- write them), in one row that the routing trigger reads on every producer's insert.
CREATE TABLE {q_settings} (
    singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    ord_default    boolean NOT NULL DEFAULT true,
    ord_names      text[]  NOT NULL DEFAULT ARRAY[]::text[],
    unord_names    text[]  NOT NULL DEFAULT ARRAY[]::text[],
    ord_patterns   text[]  NOT NULL DEFAULT ARRAY[]::text[],
    unord_patterns text[]  NOT NULL DEFAULT ARRAY[]::text[],
    notify         boolean NOT NULL DEFAULT true,  -- wake idle relays on insert (LISTEN/NOTIFY)
    -- Read by nothing since migration 0004 (order no longer waits for running
    -- transactions); kept so that a relay older than 0004, whose start-up writes it, is
    -- refused with a clear message (see <table>_refuse_old_settings below).
    commit_order_guard boolean NOT NULL DEFAULT true,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- Set by the relays, never by hand: while every live row of <table>_listeners is idle,
    -- the earliest of their expiry times; NULL while one of them works or none is there. Each
    -- relay recomputes it, under the settings row's lock, in the transaction that writes its
    -- own row (sql/queries.sql, listener_*), so two relays changing state at once cannot
    -- leave a stale answer behind. A killed idle relay's answer runs out with its row.
    wake_until     timestamptz,
    -- How the ingest learns commit order (0016; relay settings set --commit-order, which
    -- relay.db.commit_order carries out): 'stamp', a commit stamp per producer transaction
    -- (any producer); 'id', the outbox id (producers that lock the aggregate before they
    -- insert: the stamp trigger is off and <table>_fresh_idx is on (id)).
    commit_order   text NOT NULL DEFAULT 'stamp'
                   CONSTRAINT {n_settings_commit_order_check} CHECK (commit_order IN ('stamp', 'id'))
);
INSERT INTO {q_settings} DEFAULT VALUES;

-- Routing, the payload's size and the wake-up, from one read of the settings row.
-- pg_notify runs once per row while a relay is idle; PostgreSQL folds a transaction's
-- identical notifications into one, and sends it at COMMIT. A relay that is working claims
-- new rows at its next claim anyway, so its producers' commits skip the database-wide
-- lock that a notifying transaction takes at COMMIT. The size is the payload's before it
-- is stored: pg_column_size() then reads its length header, whatever the payload's size,
-- where the stored value would count a compressed payload by its compressed size. The
-- channel is the outbox's ("schema.table") also when the row lands in a partition (0018).
CREATE FUNCTION {q_route}() RETURNS trigger
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

CREATE TRIGGER {n_route} BEFORE INSERT ON {outbox}
    FOR EACH ROW EXECUTE FUNCTION {q_route}();

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

-- Each relay process that LISTENs keeps one row here: idle (every worker of the process
-- found nothing and waits for a wake-up) or not (one of them is working), valid until
-- expires_at by the database clock. The process renews it while it runs and deletes it
-- when it stops; a crashed process's row expires by itself. The relays fold these rows
-- into <table>_settings.wake_until, which the routing trigger reads.
CREATE TABLE {q_listeners} (
    owner      text        PRIMARY KEY,  -- host:pid of the relay process
    idle       boolean     NOT NULL,     -- true: waiting for a wake-up; false: working
    expires_at timestamptz NOT NULL      -- database clock; past it the row counts for nothing
);

-- ---- Ordered delivery: commit stamps, numbering, heads
--
-- Per-aggregate order is commit order, numbered without gaps (aggregate_seq):
-- * A deferred constraint trigger draws a commit stamp for every producer transaction that
--   wrote ordered rows, at COMMIT, while the transaction still holds every lock it took
--   (one row in <table>_commits per transaction, not per event). Stamps come from one
--   sequence with CACHE 1, so a transaction whose commit finished before another began
--   committing always has the smaller stamp.
-- * The ingest (one relay at a time, see sql/queries.sql) numbers newly committed ordered
--   rows: each gets its aggregate's next number, aggregate_seq = 1, 2, 3, ... with no gaps,
--   in the order the rows became visible to it, and by (stamp, id) among rows that became
--   visible together. Nothing waits for transactions that are still running: a row is
--   numbered once it is visible, and whatever commits later gets a later number.
-- * Ordered rows are claimed through <table>_heads: one row per aggregate naming its
--   earliest unfinished ordered message and when that message may be claimed. Claims read
--   only heads that are ready, however many messages wait behind them or however many
--   aggregates are blocked by a dead head.

-- Commit stamps: one per producer transaction that wrote ordered rows, drawn at COMMIT.
-- CACHE 1 (the default) is required: with a cache, each session draws from its own block
-- of numbers and the stamps would no longer follow commit order across sessions.
CREATE SEQUENCE {q_commit_stamp} CACHE 1;

CREATE TABLE {q_commits} (
    stamp bigint PRIMARY KEY,  -- the ingest walks committed transactions in stamp order
    xid   xid8   NOT NULL      -- the transaction, matched to its rows' xid column
);

-- Runs at COMMIT (deferred) for every ordered row a transaction inserted; only the first
-- call of a transaction writes. The flag is transaction-local and keyed by the outbox's
-- oid, so two outboxes written in one transaction each get their stamp (the root's, 0018:
-- rows of one transaction in two partitions of a partitioned outbox share one). SECURITY DEFINER
-- (0011): it writes as the owner, so producers need no grant on <table>_commits or the
-- sequence and cannot forge stamps; the search_path is pinned against anything a
-- producer's session puts on its own.
CREATE FUNCTION {q_stamp}() RETURNS trigger
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

CREATE CONSTRAINT TRIGGER {n_stamp} AFTER INSERT ON {outbox}
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.ordered)
    EXECUTE FUNCTION {q_stamp}();

-- Serializes the ingest: the relay that holds this row's lock numbers; the others skip.
CREATE TABLE {q_ingest} (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The epoch counter (0017): the last value a new epoch's name took
    -- ('<timeline>.<first seq>.n<value>'), bumped by the ingest under this row's lock, so
    -- an epoch opened later has a larger value.
    epochs    bigint  NOT NULL DEFAULT 0
);
INSERT INTO {q_ingest} DEFAULT VALUES;

CREATE TABLE {q_heads} (
    aggregate_id text PRIMARY KEY,
    head_id      bigint,       -- earliest unfinished ordered row, by aggregate_seq; NULL: nothing waits
    head_xid     xid8,         -- unused since migration 0004, which kept it for relays older than it
    ready_at     timestamptz,  -- when the head may be claimed; NULL while leased, dead or absent
    -- Each aggregate's counter: the last aggregate_seq handed out. The sequence is gapless
    -- for as long as this row is kept: only `relay prune --heads-idle-for` deletes it, for
    -- an aggregate with nothing unfinished that has numbered nothing for that long.
    last_seq     bigint NOT NULL DEFAULT 0,
    -- When the ingest last numbered a row of the aggregate (0013; rows that existed then
    -- count from the migration).
    numbered_at  timestamptz NOT NULL DEFAULT now(),
    -- The epoch the ingest numbers in (0015; NULL until it numbers a row after 0015).
    epoch        text,
    -- The largest outbox id numbered for the aggregate (0016; NULL until the ingest numbers
    -- one after 0016). Under --commit-order id, a row that becomes visible with a smaller
    -- id was committed out of id order: the relay warns.
    last_id      bigint
);

CREATE INDEX {n_heads_ready_idx} ON {q_heads} (ready_at) WHERE ready_at IS NOT NULL;

-- An aggregate's unfinished ordered rows (numbered, and pending, processing or dead): what
-- the heads trigger chooses the next head from, what `relay status` counts behind a dead
-- head and what `relay explain` counts, defined once. A plain SQL function, STABLE and not
-- STRICT, so PostgreSQL inlines it into each caller's plan: the same index scan on
-- <table>_aggregate_seq_idx as the filter written out, and no function call per row.
CREATE FUNCTION {q_unfinished_ordered}(aggregate text)
RETURNS TABLE (id bigint, status text, available_at timestamptz, aggregate_seq bigint)
LANGUAGE sql STABLE
AS $$
    SELECT o.id, o.status, o.available_at, o.aggregate_seq
      FROM {outbox} AS o
     WHERE o.aggregate_id = aggregate
       AND o.ordered
       AND o.status IN ('pending', 'processing', 'dead')
       AND o.aggregate_seq IS NOT NULL
$$;

-- What became of a row, for every command that reads history (relay replay, relay explain,
-- the console): 'delivered' (done, and not by an operator's skip), 'skipped' (done without
-- delivery: relay dead skip, or relay prune --skip-blocking), or the status of a row that
-- has not finished ('pending', 'processing', 'dead'). A skipped row was never published
-- live and an operator decided it must not be: a replay leaves it out unless asked. A
-- plain SQL function, IMMUTABLE, so PostgreSQL inlines it into each caller's plan.
CREATE FUNCTION {q_history}(status text, resolution text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN status = 'done' AND resolution IS NOT DISTINCT FROM 'skipped' THEN 'skipped'
        WHEN status = 'done' THEN 'delivered'
        ELSE status
    END
$$;

-- The event id the relay sends (0015): the row's own, or for a row written before 0015
-- one derived from what identifies it, the same at every delivery and replay.
CREATE FUNCTION {q_event_id}(event_id uuid, id bigint, xid xid8, created_at timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT coalesce(event_id, md5('outbox-relay/' || id || '/' || xid || '/' || extract(epoch FROM created_at))::uuid)
$$;

-- Keeps every head in step with its row, whoever changes the row: the relay's finalize,
-- the reaper, an operator's re-drive or skip, or a hand-written UPDATE or DELETE.
CREATE FUNCTION {q_follow_heads}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- The relay's claim and ingest move their heads themselves, in the same statements,
    -- and say so for the rest of their transaction; nothing to follow then.
    IF current_setting('outbox_relay.claiming', true) = 'on' THEN
        RETURN NULL;
    END IF;

    -- Lock the heads this statement touched, in aggregate order (the ingest locks in the
    -- same order, so the two cannot deadlock), in a statement of their own: every statement
    -- below then runs on a snapshot taken after any concurrent ingest of these aggregates
    -- has committed, and sees the rows it numbered. (A lateral lookup per changed row
    -- keeps it an index probe: the planner has no statistics for a transition table.)
    PERFORM 1
       FROM (SELECT DISTINCT n.aggregate_id, n.id
               FROM changed AS n
              WHERE n.ordered
              ORDER BY n.aggregate_id) AS n,
            LATERAL (SELECT 1
                       FROM {q_heads} AS h
                      WHERE h.aggregate_id = n.aggregate_id
                        AND h.head_id = n.id
                        FOR UPDATE) AS locked;
    IF NOT FOUND THEN
        RETURN NULL;  -- no head changed: the common case for unordered rows
    END IF;

    IF TG_OP = 'UPDATE' THEN
        -- A head that is pending again (retry, defer, expired lease, re-drive) is ready at
        -- its available_at; one that is processing or dead is not claimable.
        UPDATE {q_heads} AS h
           SET ready_at = CASE WHEN n.status = 'pending' THEN n.available_at END
          FROM changed AS n
         WHERE n.ordered
           AND n.status IN ('pending', 'processing', 'dead')
           AND h.aggregate_id = n.aggregate_id
           AND h.head_id = n.id
           AND h.ready_at IS DISTINCT FROM CASE WHEN n.status = 'pending' THEN n.available_at END;
    END IF;

    -- A head that finished (done, or deleted): the unfinished row with the next number
    -- takes over, or nothing does, and the ingest offers the aggregate's next row when it
    -- numbers one.
    UPDATE {q_heads} AS h
       SET head_id  = nxt.id,
           ready_at = CASE WHEN nxt.status = 'pending' THEN nxt.available_at END
      FROM changed AS n
      LEFT JOIN LATERAL (
            SELECT u.id, u.status, u.available_at
              FROM {q_unfinished_ordered}(n.aggregate_id) AS u
             ORDER BY u.aggregate_seq
             LIMIT 1
      ) AS nxt ON true
     WHERE n.ordered
       AND (TG_OP = 'DELETE' OR n.status = 'done')
       AND h.aggregate_id = n.aggregate_id
       AND h.head_id = n.id;
    RETURN NULL;
END
$$;

CREATE TRIGGER {n_follow_heads_upd} AFTER UPDATE ON {outbox}
    REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();

CREATE TRIGGER {n_follow_heads_del} AFTER DELETE ON {outbox}
    REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION {q_follow_heads}();

-- ---- Partitions (0018)

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

-- ---- Kept only to stop relays older than migration 0004 with a clear message
--
-- Up to 0003 an aggregate was ordered by (xid, id), a row became a head only below the
-- oldest running transaction id (the "commit-order guard"), and the ingest advanced the
-- cursor below. Such a relay would offer heads by the old rule; the table <table>_cursor,
-- the column <table>_heads.head_xid and the setting commit_order_guard remain so that it
-- fails instead. A later migration drops them.

-- Rows of transactions below this xid had been offered to the heads table (before 0004).
CREATE TABLE {q_cursor} (
    singleton    boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    ingested_xid xid8    NOT NULL
);
INSERT INTO {q_cursor} (ingested_xid) VALUES ('0');

-- Relays older than 0004: their start-up writes commit_order_guard, and their ingest
-- advances <table>_cursor. Both fail, with this message, before anything changes.
CREATE FUNCTION {q_refuse_old_relay}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    RAISE EXCEPTION 'the outbox in schema % was upgraded to migration 0004 (ordering by aggregate_seq);'
                    ' this relay is older and must be upgraded before it runs against it', TG_TABLE_SCHEMA
        USING HINT = 'install the outbox-relay release that ships sql/migrations/0004_aggregate_seq.sql on every relay host';
END
$$;

CREATE TRIGGER {n_refuse_old_settings} BEFORE UPDATE OF commit_order_guard ON {q_settings}
    FOR EACH ROW EXECUTE FUNCTION {q_refuse_old_relay}();

CREATE TRIGGER {n_refuse_old_cursor} BEFORE UPDATE ON {q_cursor}
    FOR EACH ROW EXECUTE FUNCTION {q_refuse_old_relay}();

-- ---- Dead messages grouped by error (0014)

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

-- Groups counted and paged from the index alone; a group's rows in id order.
CREATE INDEX {n_dead_group_idx} ON {outbox} (dead_group, id) WHERE status = 'dead';
-- The console's overview counts the dead messages of each event type it lists; relay
-- status finds the dead rows that block an aggregate (only ordered ones can) without
-- reading a million unordered dead rows.
CREATE INDEX {n_dead_type_idx} ON {outbox} (event_type) WHERE status = 'dead';
CREATE INDEX {n_dead_ordered_idx} ON {outbox} (aggregate_id) WHERE status = 'dead' AND ordered;

-- ---- The claim-check's objects (0019)
--
-- A relay records each object it is about to store (relay.claimcheck; before it writes it,
-- so that no object exists that this table does not name), and relay prune deletes an object
-- once the row it was stored for has left history (a prune's DELETE, a dropped partition),
-- then its row here. Rows of one event id share one object (its key is derived from the event
-- id): the latest of them keeps it.
CREATE TABLE {q_payloads} (
    ref       text        PRIMARY KEY,             -- s3://<bucket>/<key>
    outbox_id bigint      NOT NULL,                -- the row it was stored for; kept while that row is in history
    stored_at timestamptz NOT NULL DEFAULT now()   -- when it was recorded, before the object was written
);
-- relay prune walks it in the outbox's id order: its probes of the outbox's primary key then
-- go in order too (10 s for 1,000,000 objects in reference order, which is random).
CREATE INDEX {n_payloads_row_idx} ON {q_payloads} (outbox_id, ref);

-- ---- The migration ledger
--
-- What `relay migrate` creates before it applies anything (relay.db.migrate) and the row it
-- records for each migration: here every migration, so that `relay migrate` sees this
-- schema as up to date. A new migration adds its row here.
CREATE TABLE {q_migrations} (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {q_migrations} (version, name) VALUES
    (1, 'outbox'),
    (2, 'heads'),
    (3, 'ops'),
    (4, 'aggregate_seq'),
    (5, 'aggregate_id_limit'),
    (6, 'payload_bytes'),
    (7, 'idle_wakeups'),
    (8, 'cheap_inserts'),
    (9, 'unfinished_ordered'),
    (10, 'headers'),
    (11, 'stamp_as_owner'),
    (13, 'history'),
    (14, 'dead_groups'),
    (15, 'event_identity'),
    (16, 'commit_order'),
    (17, 'epoch_counter'),
    (18, 'partitioning'),
    (19, 'stored_payloads');
