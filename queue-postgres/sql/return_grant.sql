-- Returns a queue handle's grant (grant.sql): its row deleted, its room back for the others'
-- claims and grants at once (a handle whose claim found nothing due, or that claims under the
-- lock from now on). A claim on it that runs meanwhile finds no row and fails. Its entry in
-- the queue's rate log (grant.sql) stays: the rate counts its jobs until a window after its
-- expiry, started or not.
--
-- Parameters: $1 queue; $2 the grant.
DELETE FROM "{{table}}_grants" WHERE queue = $1 AND grant_id = $2
