-- Switches room grants (grant.sql) on or off for a queue: the operator's promise that every
-- worker of the queue runs a release that counts grants (docs/operations.md, "Room grants").
--
-- Parameters: $1 queue; $2 on. Returns whether it is on. A change deletes the queue's grants
-- (the table's trigger, table migration 20261212000001) and moves the claims counter, so
-- that a claim under the lock whose snapshot holds grants this change deleted, or counted none
-- that the switch now allows, is stale and claims again after the lock (claim_quota.sql
-- counts the grants only while the switch is on); a claim ahead is refused while it is on.
INSERT INTO "{{table}}_queues" AS c (queue, room_grants)
VALUES ($1, $2)
ON CONFLICT (queue) DO UPDATE
SET room_grants = EXCLUDED.room_grants,
    claims = c.claims + CASE WHEN c.room_grants IS DISTINCT FROM EXCLUDED.room_grants
                             THEN 1 ELSE 0 END,
    updated_at = now()
RETURNING room_grants
