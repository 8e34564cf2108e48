-- An operator reopens a job that ended: back to pending, due now, attempts and reclaims reset,
-- the lease and any cancel request cleared. The generation keeps counting (a fence token is
-- never reused) and the error history stays.
--
-- Parameters: $1 id; $2 queue; $3 the status the operator saw (dead, failed or cancelled).
-- Guarded on it: a job that moved on meanwhile is left alone. Returns the reopened row, or, when
-- nothing changed, the status the job is in (no row: no such job).
WITH reopened AS (
    UPDATE "{{table}}"
    SET status = 'pending', attempts = 0, reclaims = 0, next_attempt_at = now(),
        claimed_at = NULL, lease_expires_at = NULL, lease_generation = NULL,
        cancel_requested_at = NULL, finished_at = NULL, updated_at = now()
    WHERE id = $1 AND queue = $2 AND status = $3
    RETURNING {{columns}}
)
SELECT true AS reopened, {{columns}} FROM reopened
UNION ALL
SELECT false AS reopened, {{columns}} FROM "{{table}}"
WHERE id = $1 AND queue = $2 AND NOT EXISTS (SELECT 1 FROM reopened)
