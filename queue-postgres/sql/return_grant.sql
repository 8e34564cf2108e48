-- Returns a queue handle's grant (grant.sql): its row deleted, its room back for the others'
-- claims and grants at once (a handle whose claim found nothing due, or that claims under the
-- lock from now on). A claim on it that runs meanwhile finds no row and fails. Under a rate,
-- its entry in the queue's rate log becomes the jobs its claims took, at the delete
-- (grant_log.sql): the queue's row is written, so the return waits for its lock.
--
-- Parameters: $1 queue; $2 the grant.
WITH swept AS (
    DELETE FROM "{{table}}_grants" AS g
    WHERE g.queue = $1 AND g.grant_id = $2
    RETURNING {{swept_returning}}
)
UPDATE "{{table}}_queues" AS c
SET rate_log = {{rewritten_log}}
WHERE c.queue = $1
  AND c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL
  AND EXISTS (SELECT 1 FROM swept)
