-- An operator's cancel: a pending job is cancelled, a job in flight gets a cancel request for
-- its holder (who alone ends it), and the status the statement saw comes back.
--
-- Parameters: $1 id; $2 queue; $3 the reason written on a pending job.
-- Returns at most one row (no row: no such job in this queue): whether the job was cancelled,
-- whether its cancel was requested, and its status in the statement's snapshot. A job seen
-- pending or in flight but neither cancelled nor requested changed meanwhile: ask again.
--
-- Statuses are compared with a subquery's value so the row is read by primary key, never
-- through a status's partial index whatever the statistics say (see extend_lease.sql).
WITH cancelled AS (
    UPDATE "{{table}}"
    SET status = 'cancelled', last_error = $3, updated_at = now(), finished_at = now(),
        lease_expires_at = NULL
    WHERE id = $1 AND queue = $2 AND status = (SELECT 'pending')
    RETURNING id
),
requested AS (
    UPDATE "{{table}}"
    SET cancel_requested_at = COALESCE(cancel_requested_at, now()), updated_at = now()
    WHERE id = $1 AND queue = $2 AND status = (SELECT 'in_flight')
    RETURNING id
)
SELECT EXISTS (SELECT 1 FROM cancelled) AS cancelled,
       EXISTS (SELECT 1 FROM requested) AS requested,
       status
FROM "{{table}}" WHERE id = $1 AND queue = $2
