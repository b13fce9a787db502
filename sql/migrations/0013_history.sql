-- 0013: one rule for what a finished row's history is, and heads that can be forgotten.
--
-- <table>_history(status, resolution) says what became of a row, for every command that
-- reads history (relay replay, relay explain, the console): 'delivered' (done, and not by
-- an operator's skip), 'skipped' (done without delivery: relay dead skip, or relay prune
-- --skip-blocking), or the status of a row that has not finished ('pending', 'processing',
-- 'dead'). A skipped row was never published live and an operator decided it must not
-- be; a replay leaves it out unless asked (--include-skipped). A plain SQL function,
-- IMMUTABLE, so PostgreSQL inlines it into each caller's plan.
CREATE FUNCTION {q_history}(status text, resolution text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE
        WHEN status = 'done' AND resolution IS NOT DISTINCT FROM 'skipped' THEN 'skipped'
        WHEN status = 'done' THEN 'delivered'
        ELSE status
    END
$$;

-- When the ingest last numbered a row of the aggregate. `relay prune --heads-idle-for`
-- forgets the heads row (and with it the aggregate's counter) of an aggregate with nothing
-- unfinished that has numbered nothing for that long, so <table>_heads does not keep a row
-- for every aggregate ever seen. A constant default is stored once in the catalog
-- (PostgreSQL 11 and later): nothing is rewritten, and rows that exist count from now.
ALTER TABLE {q_heads} ADD COLUMN numbered_at timestamptz NOT NULL DEFAULT now();
