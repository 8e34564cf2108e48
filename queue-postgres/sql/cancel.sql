-- Administrative cancel of a pending job, and what the job's status was otherwise, in one
-- statement.
--
-- Parameters: $1 id; $2 queue.
-- Returns at most one row: cancelled true, or cancelled false with the status the statement's
-- snapshot saw (no row: no such job in this queue). A job seen pending but not cancelled was
-- claimed or released meanwhile: the caller asks again.
WITH cancelled AS (
    UPDATE "{{table}}" SET status = 'cancelled', updated_at = now(), finished_at = now()
    WHERE id = $1 AND queue = $2 AND status = 'pending'
    RETURNING id
)
SELECT EXISTS (SELECT 1 FROM cancelled) AS cancelled, status
FROM "{{table}}" WHERE id = $1 AND queue = $2
