-- The claim: recovery folded in, by the database's clock only.
--
-- Parameters: $1 queue; $2 batch size; $3 lease in seconds; $4 reclaim cap; $5 the claimer's
-- name (claimed_by; NULL for none); $6 the claim's token (queue_core::ClaimToken, 64 random bits
-- the claimer drew for this claim).
--
-- Takes due pending jobs, and in-flight jobs whose lease expired, in next_attempt_at then
-- priority order. A job's lease is its own, stored with its claim (lease_expires_at, and
-- lease_generation: the claim it belongs to), never the claimer's. A row whose stored expiry is
-- missing or belongs to another claim was claimed by a binary from before stored leases: it
-- counts the claimer's lease ($3) from claimed_at instead (which that binary's heartbeats move
-- on), and a row with neither (what a pre-lease release stranded) is taken at once. Each predicate is its own ordered,
-- index-backed FOR UPDATE SKIP LOCKED pick, so the cost stays flat however large the backlog;
-- PostgreSQL refuses FOR UPDATE under UNION, hence two materialized CTEs merged afterwards.
--
-- Every claimed row gets status in_flight, attempts + 1, claimed_at = now(), lease_expires_at =
-- now() + $3, claim_generation + 1 with lease_generation equal to it, and claim_token = $6: the
-- fence every later write compares, the token because a primary that lost this claim in a
-- failover would count to the same generation again (migration 20261204000001). A
-- takeover also counts a reclaim, and one past the reclaim cap comes back flagged
-- over_reclaim_cap (its holder ends it dead through finalize.sql, with the hooks); a job whose
-- cancel an operator requested comes back flagged cancel_requested (its holder ends it
-- cancelled). A queue an operator paused ("{{table}}_queues".paused_at set) gives nothing: the
-- check is one primary-key read, done once per claim. Rows come back in claim order, each with when it was due (due_at: the worker's
-- start-lag metric).
WITH due AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, false AS expired
    FROM "{{table}}"
    WHERE queue = $1 AND status = 'pending' AND next_attempt_at <= now()
      AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                      WHERE c.queue = $1 AND c.paused_at IS NOT NULL)
    ORDER BY next_attempt_at, priority, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
expired AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, true AS expired
    FROM "{{table}}"
    WHERE queue = $1 AND status = 'in_flight'
      AND (lease_expires_at < now() OR lease_expires_at IS NULL)
      AND (lease_generation = claim_generation
           OR claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))
      AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                      WHERE c.queue = $1 AND c.paused_at IS NOT NULL)
    ORDER BY lease_expires_at NULLS FIRST
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
picked AS (
    SELECT id, expired, reclaims
    FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS candidates
    ORDER BY next_attempt_at, priority, id
    LIMIT $2
),
claimed AS (
    UPDATE "{{table}}" AS j
    SET status = 'in_flight',
        attempts = j.attempts + 1,
        reclaims = j.reclaims + CASE WHEN p.expired THEN 1 ELSE 0 END,
        claimed_at = now(),
        claimed_by = $5,
        lease_expires_at = now() + make_interval(secs => $3),
        lease_generation = j.claim_generation + 1,
        claim_generation = j.claim_generation + 1,
        claim_token = $6,
        updated_at = now()
    FROM picked AS p
    WHERE j.id = p.id
    RETURNING j.id, j.claim_generation, j.claim_token, j.attempts, j.reclaims, j.claimed_at, j.priority,
              j.payload, j.next_attempt_at, p.expired AS taken_over,
              (p.expired AND p.reclaims >= $4) AS over_reclaim_cap,
              j.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested
FROM claimed
ORDER BY next_attempt_at, priority, id
