-- The claim's picks and its update, shared by claim.sql, finalize_claim.sql and
-- claim_limited.sql (each renders this file in place of its claim_picks token, after a CTE due:
-- the pending jobs to take, claim_due.sql's pick or claim_limited.sql's; claim.sql says what
-- they guarantee). Parameters as claim.sql's, $1 to $7; finalize_claim.sql shifts them past its
-- own. Rendered with two tokens: batch, how many picked jobs to take ($2, or claim_limited.sql's
-- quota: all within the rate; takeovers stop at $2), limited_guard, what else keeps the
-- takeovers from a queue besides a pause (claim.sql's: limits, which only claim_limited.sql
-- applies; claim_limited.sql's: partitions taking turns, when claim_turns.sql takes them over;
-- claim_turns.sql's: nothing), and candidates, the due jobs and takeovers to choose from
-- (claim.sql's: all of them; the limited forms': each partition's earliest within the starts
-- its rate leaves, claim_candidates.sql), claim_now, the claim's instant (claim.sql's: now();
-- the limited forms': the instant their limits count by, after the queue's lock, so that
-- claimed_at shows each claim where the rates placed it), and expired_starts, what else keeps
-- an expired lease from being taken over (the limited forms': its partition has no start left).
expired AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, true AS expired, partition_key
    FROM "{{table}}" AS x
    WHERE queue = $1 AND status = 'in_flight'
      AND (lease_expires_at < now() OR lease_expires_at IS NULL)
      AND (lease_generation = claim_generation
           OR claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))
      AND id <> ALL($7::bigint[])
      {{expired_starts}}
      AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                      WHERE c.queue = $1 AND (c.paused_at IS NOT NULL {{limited_guard}}))
    ORDER BY lease_expires_at NULLS FIRST
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
picked AS (
    SELECT id, expired, reclaims
    FROM {{candidates}}
    ORDER BY next_attempt_at, priority, id
    LIMIT {{batch}}
),
-- The write names its rows by id alone, not by a join with the picks: the primary key is then
-- its only path, whatever the statistics say (a join let the planner scan the whole table when
-- the table looked small). A pick is a takeover exactly when its row is in flight, which the
-- pick's row lock keeps true until this write; the flags are joined back from the picks.
written AS (
    UPDATE "{{table}}" AS j
    SET status = 'in_flight',
        attempts = j.attempts + 1,
        reclaims = j.reclaims + CASE WHEN j.status = 'in_flight' THEN 1 ELSE 0 END,
        claimed_at = {{claim_now}},
        claimed_by = $5,
        lease_expires_at = {{claim_now}} + make_interval(secs => $3),
        lease_generation = j.claim_generation + 1,
        claim_generation = j.claim_generation + 1,
        claim_token = $6,
        updated_at = now()
    WHERE j.id = ANY (ARRAY(SELECT id FROM picked))
    RETURNING j.id, j.claim_generation, j.claim_token, j.attempts, j.reclaims, j.claimed_at, j.priority,
              j.payload, j.next_attempt_at, j.cancel_requested_at IS NOT NULL AS cancel_requested,
              j.partition_key
),
claimed AS (
    SELECT w.id, w.claim_generation, w.claim_token, w.attempts, w.reclaims, w.claimed_at,
           w.priority, w.payload, w.next_attempt_at, p.expired AS taken_over,
           (p.expired AND p.reclaims >= $4) AS over_reclaim_cap, w.cancel_requested,
           w.partition_key
    FROM written AS w JOIN picked AS p ON p.id = w.id
)
