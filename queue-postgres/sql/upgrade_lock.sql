-- The legacy upgrade's own lock, so that two runners never work on one table at once (one would
-- take the other's index build in progress for a failed one). A session-level advisory lock
-- held on a connection that stays idle (no snapshot, so concurrent index builds do not wait for
-- it); $2 false releases it.
--
-- Parameters: $1 the table's name; $2 true to take the lock, false to release it.
SELECT CASE WHEN $2 THEN pg_try_advisory_lock(hashtext('queue_framework.upgrade'), hashtext($1))
            ELSE pg_advisory_unlock(hashtext('queue_framework.upgrade'), hashtext($1)) END AS held
