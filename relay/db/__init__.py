"""The database layer: every statement the product runs, by name, and the rows they return.

The statements themselves live in ``sql/*.sql`` under ``-- name --`` headers (read once by
:mod:`relay.db.statements`); the modules here are the only code that names them, binds
their parameters and turns their rows into frozen, typed objects. Nothing above this
package sees SQL text; nothing in it decides policy.

- :mod:`relay.db.session`: connections, pools and how every session is set up; the
  errors that mean "the database, not the statement" (retried by the callers).
- :mod:`relay.db.names`: an outbox's schema and table, checked, and statements rendered
  with them (identifiers only ever through :mod:`psycopg.sql`).
- :mod:`relay.db.statements`: where ``sql/`` is and its named statements, parsed once.
- :mod:`relay.db.dispatch`: what the running relay does: claim, finalize, the listeners'
  presence rows.
- :mod:`relay.db.settings`: the settings every relay of an outbox shares.
- :mod:`relay.db.readmodel`: what operators and the console read (status, dead messages,
  blocked aggregates, one message), and the readiness probe.
- :mod:`relay.db.actions`: what operators change (dead messages retried or skipped,
  leases released).
- :mod:`relay.db.history`: retention (done rows pruned, idle aggregates' counters forgotten).
- :mod:`relay.db.replay`: the plan a replay takes and pages through.
"""
