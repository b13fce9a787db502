"""The design reference's outbox table and indexes, nothing of the relay's: the baseline
that bench_db.py runs its queries against and bench_producer.py inserts into."""

# {t} is the table's qualified name, filled in with psycopg.sql by the caller.
REFERENCE_DDL = """
CREATE TABLE {t} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL,
    payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
    status text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'processing', 'done', 'dead')),
    available_at timestamptz NOT NULL DEFAULT now(), attempts integer NOT NULL DEFAULT 0,
    lease_owner text, lease_until timestamptz, lease_version bigint NOT NULL DEFAULT 0,
    last_error text, done_at timestamptz);
CREATE INDEX ON {t} (available_at, id) WHERE status = 'pending';
CREATE INDEX ON {t} (lease_until) WHERE status = 'processing';
CREATE INDEX ON {t} (aggregate_id, id);
"""
