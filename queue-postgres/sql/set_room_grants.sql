-- Switches room grants (grant.sql) on or off for a queue (docs/operations.md, "Room grants";
-- an older release's claims fail while it is on: the fence, table migration
-- 20261213000001).
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
    -- This release counts room grants (table migration 20261213000001, the fence).
    grants_counted = NOT c.grants_counted,
    updated_at = now()
RETURNING room_grants
