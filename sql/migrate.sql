-- The statements `relay migrate` runs besides the migrations themselves (relay.db.migrate),
-- one per `-- name --` header with a one-line description, loaded beside queries.sql by
-- relay.db.statements. Values are always bound parameters.

-- migrate_access --
-- Who is migrating and what that role may do, asked before anything is created so that a refusal can name the privilege it lacks.
SELECT current_user::text                                     AS role,
       current_database()::text                               AS database,
       n.oid IS NOT NULL                                      AS schema_exists,
       has_database_privilege(current_database(), 'CREATE')   AS may_create_schema,
       coalesce(has_schema_privilege(n.oid, 'USAGE'), false)  AS may_use_schema,
       coalesce(has_schema_privilege(n.oid, 'CREATE'), false) AS may_create_in_schema,
       EXISTS (SELECT 1 FROM pg_class AS c
                WHERE c.relnamespace = n.oid AND c.relname = %(ledger)s) AS ledger_exists
  FROM (SELECT 1) AS one
  LEFT JOIN pg_namespace AS n ON n.nspname = %(schema)s;

-- migrate_outboxes --
-- The outboxes in a schema (a table beside its "<table>_migrations" ledger), to say whose object a name collides with.
SELECT t.relname::text AS outbox
  FROM pg_class AS l
  JOIN pg_namespace AS n ON n.oid = l.relnamespace
  JOIN pg_class AS t ON t.relnamespace = n.oid AND t.relkind IN ('r', 'p')
                    AND l.relname = t.relname || '_migrations'
 WHERE n.nspname = %(schema)s AND l.relkind = 'r';
