-- The claim: recovery folded in, by the database's clock only.
--
-- Parameters: $1 queue; $2 batch size; $3 lease in seconds; $4 reclaim cap; $5 the claimer's
-- name (claimed_by; NULL for none); $6 the claim's token (queue_core::ClaimToken, 64 random bits
-- the claimer drew for this claim); $7 ids never to take over (the jobs finalize_claim.sql
-- finalizes in the same statement, so that a row is never written twice by one statement; empty
-- for a claim alone).
--
-- Takes due pending jobs, and in-flight jobs whose lease expired, in next_attempt_at then
-- priority order. A job's lease is its own, stored with its claim (lease_expires_at, and
-- lease_generation: the claim it belongs to), never the claimer's. A row whose stored expiry is
-- missing or belongs to another claim was claimed by a binary from before stored leases: it
-- counts the claimer's lease ($3) from claimed_at instead (which that binary's heartbeats move
-- on), and a row with neither (what a pre-lease release stranded) is taken at once. Each predicate is its own ordered,
-- index-backed FOR UPDATE SKIP LOCKED pick, so the cost stays flat however large the backlog;
-- PostgreSQL refuses FOR UPDATE under UNION, hence two materialized CTEs merged afterwards (in
-- claim_picks.sql, which finalize_claim.sql shares).
--
-- Every claimed row gets status in_flight, attempts + 1, claimed_at = now(), lease_expires_at =
-- now() + $3, claim_generation + 1 with lease_generation equal to it, and claim_token = $6: the
-- fence every later write compares, the token because a primary that lost this claim in a
-- failover would count to the same generation again (migration 20261204000001). A
-- takeover also counts a reclaim, and one past the reclaim cap comes back flagged
-- over_reclaim_cap (its holder ends it dead through finalize.sql, with the hooks); a job whose
-- cancel an operator requested comes back flagged cancel_requested (its holder ends it
-- cancelled). A queue an operator paused ("{{table}}_queues".paused_at set) gives nothing: the
-- check is one primary-key read, done once per claim. So does a queue with limits
-- (max_in_flight, rate_starts, max_per_partition): claim_limited.sql claims from it, under the
-- queue row's lock. Rows come back in claim order, each with when it was due (due_at: the worker's
-- start-lag metric).
WITH due AS MATERIALIZED (
{{claim_due}}
),
{{claim_picks}}
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested{{claim_keys}}
FROM claimed
ORDER BY next_attempt_at, priority, id
