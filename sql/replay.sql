-- `relay replay`'s statements, one per `-- name --` header, loaded beside queries.sql by
-- relay.db.statements. Placeholders as in queries.sql; values are always bound parameters.
--
-- A replay never writes the outbox: it reads finished rows (delivered ones; skipped and
-- dead ones when asked, by the history rule <table>_history) through a plan kept in a temporary table of its own session. The plan is taken once, in
-- one statement, so the replay works on the rows that had finished when it began, in
-- this order:
--   * Per aggregate, delivery order: ordered rows by aggregate_seq (the order the live
--     relay delivered them in, which is commit order and may differ from id order when
--     producers do not lock the aggregate), unordered rows by id.
--   * Across aggregates, as close to id order as that allows: each ordered row is placed
--     at the largest id among itself and the rows before it in its aggregate (its
--     "release id": it cannot go before them). Rows whose producers locked the aggregate
--     keep their id order exactly.
-- Each plan row also carries resume_from, the smallest id among itself and every row
-- after it: once every row before a rank is confirmed, `--from-id resume_from` selects
-- everything not yet confirmed (and perhaps some that was, which consumers de-duplicate).

-- replay_plan_table --
-- The session's plan (a temporary table: no WAL, gone with the session, and nothing another session can see).
CREATE TEMPORARY TABLE IF NOT EXISTS relay_replay_plan (
    rank        bigint  PRIMARY KEY,  -- replay order, 1, 2, 3, ...
    id          bigint  NOT NULL,
    bytes       integer NOT NULL,     -- the payload's size, so a page stops at a byte budget
    resume_from bigint  NOT NULL      -- min(id) over this rank and every later one
) ON COMMIT PRESERVE ROWS;

-- replay_plan_clear --
-- A new plan replaces the last one of this session.
TRUNCATE pg_temp.relay_replay_plan;

-- replay_plan_untimed --
-- The plan's own transaction runs without a statement timeout (the session's is meant for the short statements).
SELECT set_config('statement_timeout', '0', true);

-- replay_plan --
-- The selection in replay order (see the top of this file), and what it left out. Finished rows only, by the history rule (<table>_history, migration 0013): delivered ones, skipped ones only with --include-skipped, dead ones only with --include-dead; ids given to --exclude never. The id range is always bounded (0 and the largest bigint stand for "no bound") so the primary key serves it; the other selectors filter.
WITH selected AS (
    SELECT o.id, o.aggregate_id, o.ordered, o.aggregate_seq,
           coalesce(o.payload_bytes, pg_column_size(o.payload)) AS bytes,
           {q_history}(o.status, o.resolution) AS history,
           o.id = ANY (%(excluded)s::bigint[]) AS excluded
      FROM {outbox} AS o
     WHERE o.id >= %(from_id)s::bigint
       AND o.id <= %(to_id)s::bigint
       AND o.status IN ('done', 'dead')
       AND (%(since)s::timestamptz IS NULL OR o.created_at >= %(since)s::timestamptz)
       AND (%(until)s::timestamptz IS NULL OR o.created_at < %(until)s::timestamptz)
       AND (%(aggregates)s::text[] IS NULL OR o.aggregate_id = ANY (%(aggregates)s::text[]))
       AND (%(event_names)s::text[] IS NULL
            OR o.event_type = ANY (%(event_names)s::text[])
            OR o.event_type ~ ANY (%(event_patterns)s::text[]))
), planned AS (
    INSERT INTO pg_temp.relay_replay_plan (rank, id, bytes, resume_from)
    SELECT r.rank, r.id, r.bytes, min(r.id) OVER (ORDER BY r.rank DESC ROWS UNBOUNDED PRECEDING)
      FROM (SELECT k.id, k.bytes, row_number() OVER (ORDER BY k.release_id, k.aggregate_seq, k.id) AS rank
              FROM (SELECT s.id, s.aggregate_seq, s.bytes,
                           CASE WHEN s.ordered AND s.aggregate_seq IS NOT NULL
                                THEN max(s.id) OVER (PARTITION BY s.aggregate_id, s.ordered AND s.aggregate_seq IS NOT NULL
                                                     ORDER BY s.aggregate_seq ROWS UNBOUNDED PRECEDING)
                                ELSE s.id
                           END AS release_id
                      FROM selected AS s
                     WHERE s.history = ANY (%(histories)s::text[])
                       AND NOT s.excluded
                   ) AS k
           ) AS r
    RETURNING 1
)
SELECT (SELECT count(*) FROM planned) AS planned,
       count(*) FILTER (WHERE s.history = 'skipped' AND NOT s.excluded
                          AND NOT 'skipped' = ANY (%(histories)s::text[])) AS skipped_left_out,
       count(*) FILTER (WHERE s.history = 'dead' AND NOT s.excluded
                          AND NOT 'dead' = ANY (%(histories)s::text[])) AS dead_left_out,
       count(*) FILTER (WHERE s.excluded) AS excluded_left_out
  FROM selected AS s;

-- replay_summary --
-- What the plan holds: rows (its ranks run 1 to this count), their id range, aggregates and time span (the dry run's answer, and the total a progress bar counts to).
SELECT count(*)::bigint, min(p.id), max(p.id), count(DISTINCT o.aggregate_id)::bigint,
       min(o.created_at), max(o.created_at), coalesce(sum(p.bytes), 0)::bigint
  FROM pg_temp.relay_replay_plan AS p
  LEFT JOIN {outbox} AS o ON o.id = p.id;

-- replay_page --
-- The next plan rows after rank %(after)s: at most %(count)s, and no more payload than %(budget)s bytes but at least one row. LEFT JOIN: a row pruned, or no longer what the plan took (a dead row re-driven, or skipped, meanwhile), since the plan was taken comes back without its columns and is not replayed. Columns after rank and resume_from are the claims' RETURNING list, in its order (relay.db.dispatch.message_from_row reads them).
WITH page AS (
    SELECT p.rank, p.id, p.resume_from, sum(p.bytes) OVER (ORDER BY p.rank) AS running
      FROM pg_temp.relay_replay_plan AS p
     WHERE p.rank > %(after)s::bigint
     ORDER BY p.rank
     LIMIT %(count)s
), cut AS (
    SELECT page.rank, page.id, page.resume_from
      FROM page
     WHERE page.running <= %(budget)s::bigint
        OR page.rank = (SELECT min(first.rank) FROM page AS first)
)
SELECT c.rank, c.resume_from,
       o.id, o.aggregate_type, o.aggregate_id, o.event_type,
       -- A payload the claim-check will store (over %(spool_over)s bytes) is read apart, a
       -- slice at a time (replay_spool): NULL here.
       CASE WHEN coalesce(o.payload_bytes, pg_column_size(o.payload)) > %(spool_over)s::bigint THEN NULL
            ELSE o.payload
       END AS payload,
       o.attempts, o.lease_version, extract(epoch FROM now() - o.created_at)::float8 AS age_s,
       o.ordered, o.aggregate_seq, coalesce(o.payload_bytes, pg_column_size(o.payload)) AS bytes, o.headers,
       {q_event_id}(o.event_id, o.id, o.xid, o.created_at) AS event_id, o.aggregate_epoch, o.created_at
  FROM cut AS c
  LEFT JOIN {outbox} AS o ON o.id = c.id AND {q_history}(o.status, o.resolution) = ANY (%(histories)s::text[])
 ORDER BY c.rank;

-- replay_spool --
-- A replayed row's payload over the claim-check's threshold, into the session's spool table (sql/queries.sql, payload_spool_table), as the claim's payload_spool does for a leased one.
INSERT INTO relay_spool (b)
SELECT convert_to(o.payload::text, 'UTF8')
  FROM {outbox} AS o
 WHERE o.id = %(id)s;

-- replay_resume_from --
-- Where a resumed replay starts when everything before rank %(rank)s is confirmed.
SELECT p.resume_from FROM pg_temp.relay_replay_plan AS p WHERE p.rank = %(rank)s::bigint;
