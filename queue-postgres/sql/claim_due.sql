-- The due pick of a claim (the CTE due of claim.sql and finalize_claim.sql, and plain of
-- claim_limited.sql): the queue's due pending jobs in claim order, an ordered scan of
-- "{{table}}_due_idx" that stops after due_batch rows however large the backlog, skipping rows
-- another transaction holds, with each job's partition key (claim_limited.sql's binding
-- reads it). Parameters as claim.sql's. Tokens: due_batch, how many ($2, or
-- claim_limited.sql's quota of new jobs), and limited_guard (claim_picks.sql's).
SELECT id, next_attempt_at, priority, reclaims, false AS expired, partition_key
FROM "{{table}}"
WHERE queue = $1 AND status = 'pending' AND next_attempt_at <= now()
  AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                  WHERE c.queue = $1 AND (c.paused_at IS NOT NULL {{limited_guard}}))
ORDER BY next_attempt_at, priority, id
LIMIT {{due_batch}}
FOR UPDATE SKIP LOCKED
