-- The heartbeat: the job is held for the lease ($3 seconds) more from the database's now(), and
-- claimed_at is restamped; fenced like a finalize.
--
-- Parameters: $1 id; $2 generation; $3 lease in seconds; $4 token. A row back: still held, and whether an
-- operator asked to cancel the job; no row: the lease was lost.
--
-- The status is compared with (SELECT 'in_flight'), a value the planner cannot match with the
-- in-flight partial indexes, so the row is read by primary key: on statistics taken while few
-- jobs were in flight it otherwise read every in-flight row through queue_jobs_expiry_idx.
UPDATE "{{table}}"
SET claimed_at = now(), lease_expires_at = now() + make_interval(secs => $3),
    lease_generation = claim_generation, updated_at = now()
WHERE id = $1 AND status = (SELECT 'in_flight') AND claim_generation = $2 AND claim_token = $4
RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
