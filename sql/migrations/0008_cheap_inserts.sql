-- 0008: one less table read and one less trigger in every producer's INSERT.
--
-- Up to 0007 the wake-up check was a trigger of its own (AFTER ... FOR EACH STATEMENT)
-- that read <table>_listeners on every INSERT statement: a second function call and a
-- second table read per producer transaction, on top of the routing trigger's read of
-- <table>_settings. From here on the relays keep the answer in the settings row
-- (wake_until: notify while now() is before it), and the routing trigger, which reads that
-- row anyway, notifies. scripts/bench_producer.py measures what that saves (BENCHMARKS.md,
-- "Cheaper inserts").
--
-- What stays, and why: the routing trigger (ordered or not, and the payload's size, which
-- the claims' indexes and byte budget need on the row itself, so the claims never read
-- history); the commit stamp of transactions that wrote ordered rows (one small insert at
-- COMMIT; without it, producers that do not lock an aggregate, or lock it after
-- inserting, would be numbered out of commit order: see 0004); and the CHECK constraints
-- (about 5 us per producer transaction each, measured; merging them into one saved
-- nothing measurable, since PostgreSQL prepares every expression node for each INSERT
-- statement either way).

-- ---- wake-ups: one answer in the settings row

-- Set by the relays, never by hand: while every live row of <table>_listeners is idle,
-- the earliest of their expiry times; NULL while one of them works or none is there. Each
-- relay recomputes it, under the settings row's lock, in the transaction that writes its
-- own row (sql/queries.sql, listener_*), so two relays changing state at once cannot
-- leave a stale answer behind. A killed idle relay's answer runs out with its row.
ALTER TABLE {q_settings} ADD COLUMN IF NOT EXISTS wake_until timestamptz;

UPDATE {q_settings}
   SET wake_until = (SELECT CASE WHEN bool_and(l.idle) THEN min(l.expires_at) END
                       FROM {q_listeners} AS l
                      WHERE l.expires_at > now());

-- Routing, the payload's size (0006) and now the wake-up, from one read of the settings
-- row. pg_notify runs once per row while a relay is idle; PostgreSQL folds a transaction's
-- identical notifications into one, and sends it at COMMIT.
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
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER {n_notify} ON {outbox};
DROP FUNCTION {q_notify}();
