-- What producers run (relay.Outbox, in the application's own transaction): one event, or
-- many in one statement. Loaded beside queries.sql by relay.db.statements; placeholders as
-- in queries.sql. Written with CAST(), never '::', which SQLAlchemy's text() would read as
-- part of a parameter name (relay._transactions runs them through whatever the
-- application holds).

-- outbox_insert --
-- Many events in one statement, in the order given (WITH ORDINALITY): their ids, and so their order within an aggregate, follow the list.
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, headers, event_id)
SELECT e.aggregate_type, e.aggregate_id, e.event_type, e.payload, e.headers, e.event_id
  FROM unnest(CAST(%(aggregate_types)s AS text[]), CAST(%(aggregate_ids)s AS text[]),
              CAST(%(event_types)s AS text[]), CAST(%(payloads)s AS jsonb[]),
              CAST(%(headers)s AS jsonb[]), CAST(%(event_ids)s AS uuid[]))
       WITH ORDINALITY AS e(aggregate_type, aggregate_id, event_type, payload, headers, event_id, n)
 ORDER BY e.n;

-- outbox_insert_one --
-- One event.
INSERT INTO {outbox} (aggregate_type, aggregate_id, event_type, payload, headers, event_id)
VALUES (%(aggregate_type)s, %(aggregate_id)s, %(event_type)s, CAST(%(payload)s AS jsonb),
        CAST(%(headers)s AS jsonb), CAST(%(event_id)s AS uuid));
