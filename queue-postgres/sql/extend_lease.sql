-- The heartbeat: restamps the lease clock with the database's now(), fenced like a finalize.
--
-- Parameters: $1 id; $2 generation. One row affected: Applied; none: Stale (the lease was lost).
UPDATE "{{table}}" SET claimed_at = now(), updated_at = now()
WHERE id = $1 AND status = 'in_flight' AND claim_generation = $2
