-- The claim: recovery folded in, by the database's clock only.
-- This form also writes the previous batch's outcomes first, in the same statement: one round
-- trip and one commit per batch instead of two (a worker without finalize hooks sends it).
--
-- Parameters: $1 to $10 as finalize.sql's (the outcomes, one array element each); $11 to $17
-- as claim.sql's $1 to $7, where $17 holds the outcomes' ids ($1 again): a job this statement
-- finalizes is never taken over by it, so no row is written twice by one statement.
--
-- Guarantees: each of finalize.sql's and each of claim.sql's, unchanged: every outcome is a
-- compare-and-set on (id, status, generation, token), and the claim is the same ordered,
-- index-backed SKIP LOCKED picks. Both parts commit together or not at all.
--
-- Rows: one per outcome that applied (finalized = true: id, claim_generation, claim_token),
-- then the claimed jobs as claim.sql returns them (finalized = false), in claim order.
WITH finalized AS (
{{finalize}}
),
due AS MATERIALIZED (
{{claim_due}}
),
{{claim_picks}}
SELECT true AS finalized, id, claim_generation, claim_token, NULL AS attempts,
       NULL AS reclaims, NULL AS claimed_at, NULL AS due_at, NULL AS priority, NULL AS payload,
       NULL AS taken_over, NULL AS over_reclaim_cap, NULL AS cancel_requested
FROM finalized
UNION ALL
SELECT false, id, claim_generation, claim_token, attempts, reclaims, claimed_at,
       next_attempt_at, priority, payload, taken_over, over_reclaim_cap, cancel_requested
FROM claimed
ORDER BY finalized DESC, due_at, priority, id
