-- 0007: producers send a wake-up only while every relay is idle, so a relay that is busy
-- costs the producers' commits nothing.
--
-- Up to here the insert trigger called pg_notify on every INSERT statement while the
-- stored setting notify was on. A transaction that has notified takes a database-wide
-- lock at COMMIT (PostgreSQL serializes the notification queue that way), held until the
-- commit is written: with 16 concurrent single-row producers the insert rate fell to a
-- third of a plain table's, to wake relays that were working anyway.
--
-- From here on each relay process that LISTENs keeps one row in <table>_listeners: idle
-- (every worker of the process found nothing and waits for a wake-up) or not (one of them
-- is working), valid until expires_at by the database clock. The process renews it while
-- it runs and deletes it when it stops; a crashed process's row expires by itself. The
-- trigger notifies only while at least one live row exists and every live row is idle:
--
-- * a relay that is working claims new rows at its next claim anyway, so nobody needs
--   a wake-up, and no producer's commit takes the lock;
-- * an idle relay is woken within milliseconds, as before;
-- * no relay listening (all stopped, all --no-notify) means nobody to wake.
--
-- The check reads a table of one row per relay process (one heap page) once per INSERT
-- statement; it takes no lock beyond the table's ACCESS SHARE, which every read takes.
--
-- A relay that goes idle writes its row and then claims once more before it sleeps
-- (relay.wakeup): a row committed before the idle row is found by that claim, and an
-- INSERT that runs after it sends a wake-up. Left open: a transaction whose INSERT ran
-- before the idle row committed and which commits after that last claim; its row waits
-- for the next wake-up or poll. The check runs at statement time, like the NOTIFY before
-- it. A deferred constraint trigger would check at COMMIT and shrink that window to the
-- commit itself, but constraint triggers fire once per row, not per statement, and a
-- REPEATABLE READ producer would still read the table as of its first statement.

CREATE TABLE {q_listeners} (
    owner      text        PRIMARY KEY,  -- host:pid of the relay process
    idle       boolean     NOT NULL,     -- true: waiting for a wake-up; false: working
    expires_at timestamptz NOT NULL      -- database clock; past it the row counts for nothing
);

CREATE OR REPLACE FUNCTION {q_notify}() RETURNS trigger
LANGUAGE plpgsql
AS $$
BEGIN
    -- bool_and over no rows is NULL: no live relay, no wake-up.
    IF (SELECT bool_and(l.idle) FROM {q_listeners} AS l WHERE l.expires_at > now()) THEN
        IF (SELECT s.notify FROM {q_settings} AS s) THEN
            PERFORM pg_notify(TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME, '');
        END IF;
    END IF;
    RETURN NULL;
END
$$;
