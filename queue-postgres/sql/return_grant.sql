-- Returns a queue handle's grant (grant.sql): its row deleted, its room back for the others'
-- claims and grants at once (a handle whose claim found nothing due, or that claims under the
-- lock from now on). A claim on it that runs meanwhile finds no row and fails. Under a rate,
-- its entry in the queue's rate log becomes the jobs its claims took, at the delete
-- (grant_log.sql), and under a rate per partition the queue's tally of it takes back what the
-- grant left (grant_tally_back.sql): the queue's row is written, so the return waits for its
-- lock.
--
-- Parameters: $1 queue; $2 the grant.
WITH locked AS MATERIALIZED (
    -- Under a rate, the queue's row first, as the grant statement and the trigger that
    -- deletes grants take it before the grant's row (the other order deadlocks with them).
    SELECT c.queue
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
      AND ((c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL)
           OR (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL))
    FOR UPDATE
),
swept AS (
    DELETE FROM "{{table}}_grants" AS g
    WHERE g.queue = $1 AND g.grant_id = $2
      -- Read before the delete: the lock above is taken first.
      AND (SELECT count(*) FROM locked) >= 0
    RETURNING {{swept_returning}}
)
UPDATE "{{table}}_queues" AS c
SET rate_log = CASE WHEN c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL
                    THEN {{rewritten_log}} ELSE c.rate_log END,
    -- Under a rate per partition, what the grant left goes back to the tally
    -- (grant_tally_back.sql), as when a grant statement deletes it.
    partition_tally = COALESCE(
        (SELECT c.partition_tally
                || jsonb_build_object(
                       'jobs', (c.partition_tally ->> 'jobs')::bigint - b.jobs,
                       'slots_jobs',
                       (c.partition_tally ->> 'slots_jobs')::bigint - b.jobs + b.slot_room)
         FROM ({{tally_back}}) AS b
         WHERE b.jobs > 0 OR b.slot_room > 0),
        c.partition_tally)
WHERE c.queue = $1
  AND ((c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL)
       OR (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL))
  AND EXISTS (SELECT 1 FROM swept)
