-- One batch of the retention sweep, over every queue of the table.
--
-- Parameters: $1 age in seconds; $2 batch size.
-- Deletes terminal rows finished longer ago than $1, at most $2, oldest first, skipping rows
-- someone else holds, so no statement holds many locks.
WITH doomed AS (
    SELECT id FROM "{{table}}"
    WHERE finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => $1)
    ORDER BY finished_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM "{{table}}" AS j USING doomed WHERE j.id = doomed.id
