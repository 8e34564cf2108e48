-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits on room granted to the claimer's queue handle
-- (grant.sql), without the queue's row lock and without counting the queue's jobs in flight
-- (its first line is claim.sql's, so that a drain finds it running).
--
-- Parameters: claim.sql's $1 to $7; $8 the grant.
--
-- Picks as claim.sql does, keeping at most the grant's jobs_left jobs, takeovers included (a
-- takeover puts no job in flight, but it starts one, which the queue's rate counts), and at
-- most its per_claim pending jobs of one partition (the earliest; rows picked and not kept
-- stay locked only until the commit); under a rate per partition, at most per_claim jobs of
-- one slot of partition keys (claim_slot.sql), takeovers included, in claim order (sql.rs
-- renders those candidates), and its jobs per partition logged in a row of
-- "{{table}}_claim_starts". It spends the grant in the same statement: jobs_left less its
-- jobs, claims_left less one. The spend's guard is in the update's
-- WHERE, read again on the newest version of the grant's row (two connections of one handle
-- cannot both spend its last room), backed by the table's CHECKs; the grant must also not have
-- expired. When the grant's row is gone (deleted: returned, expired and swept, the queue's
-- limits or switch changed) or has not room for the jobs taken, the statement fails with
-- SQLSTATE 22P02 and a message naming {{over}} (a cast of that text, made of the claim's job
-- count so that the planner cannot fold it into a constant), and nothing it wrote stays:
-- the caller drops the grant and claims another way. So it does when its snapshot shows the
-- grant gone, expired or spent. A claim that finds nothing due spends nothing.
--
-- Guarantees: claim.sql's, and the queue's limits in flight: every grant's room is counted by
-- the other claims (claim_quota.sql) and grants (grant.sql) until its row is deleted, and this
-- claim lowers the grant's jobs_left by at least the new jobs it puts in flight, and puts at
-- most per_claim of any one partition in flight (and no more than its new jobs), while the
-- least of the grant's per_claim * claims_left and jobs_left falls by at least as many. The
-- queue's rate: the grant was logged as all its jobs started (grant.sql), and its claims start
-- no more, each before the grant expires (the spend's guard reads the clock). The rate per
-- partition: the grant was charged to the queue's tally as its claims starting per_claim of
-- every slot each and its jobs in all (grant.sql), each before it expires, by the end of the
-- window it was charged to.
WITH room AS MATERIALIZED (
    -- per_slot: the queue has a rate per partition, so per_claim caps a slot of partition
    -- keys (claim_slot.sql), not a partition (its limits changed since the grant would have
    -- deleted the grant).
    SELECT g.jobs_left, g.per_claim,
           COALESCE((SELECT c.partition_rate_starts IS NOT NULL
                            AND c.partition_rate_per_ms IS NOT NULL
                     FROM "{{table}}_queues" AS c WHERE c.queue = $1), false) AS per_slot
    FROM "{{table}}_grants" AS g
    WHERE g.queue = $1 AND g.grant_id = $8 AND g.claims_left > 0 AND g.jobs_left > 0
      AND g.expires_at > clock_timestamp()
),
plain AS MATERIALIZED (
{{claim_due}}
),
due AS MATERIALIZED (
    SELECT p.id, p.next_attempt_at, p.priority, p.reclaims, p.expired, p.partition_key
    FROM (SELECT p.*,
                 row_number() OVER (PARTITION BY p.partition_key
                                    ORDER BY p.next_attempt_at, p.priority, p.id) AS nth
          FROM plain AS p) AS p
    WHERE p.partition_key IS NULL OR p.nth <= (SELECT per_claim FROM room)
),
{{claim_picks}},
spent AS (
    UPDATE "{{table}}_grants" AS g
    SET jobs_left = g.jobs_left - n.all_jobs,
        claims_left = g.claims_left - 1
    FROM (SELECT count(*) AS all_jobs FROM claimed) AS n
    WHERE g.queue = $1 AND g.grant_id = $8
      AND n.all_jobs > 0
      AND g.jobs_left >= n.all_jobs
      AND g.claims_left >= 1
      AND g.expires_at > clock_timestamp()
      -- Under a rate per partition every start counts, takeovers too: none of them past the
      -- cap in any slot (a claim with takeovers over it fails, and its handle claims under
      -- the lock).
      AND NOT COALESCE((SELECT r.per_slot
                                AND EXISTS (SELECT 1
                                            FROM claimed AS cl
                                            WHERE cl.partition_key IS NOT NULL
                                            GROUP BY {{claimed_slot}}
                                            HAVING count(*) > g.per_claim)
                         FROM room AS r), false)
    RETURNING g.jobs_left, g.claims_left
),
claim_started AS (
    -- Under a rate per partition, the claim's jobs per partition in one row of
    -- "{{table}}_claim_starts", keyed below zero (a claim on a grant moves no claims counter):
    -- -(grant * 1000 + the claims it leaves), a grant being for at most 32 claims. The counts
    -- per partition read these rows (claim_key_started.sql); no claim folds for them.
    INSERT INTO "{{table}}_claim_starts" (queue, claim, at_ms, keys, jobs)
    SELECT $1, -($8::bigint * 1000 + s.claims_left),
           extract(epoch FROM clock_timestamp())::float8 * 1000, k.keys, k.jobs
    FROM spent AS s
    CROSS JOIN (SELECT array_agg(x.key) AS keys, array_agg(x.jobs) AS jobs
                FROM (SELECT cl.partition_key AS key, count(*) AS jobs
                      FROM claimed AS cl
                      WHERE cl.partition_key IS NOT NULL
                      GROUP BY 1) AS x) AS k
    WHERE (SELECT per_slot FROM room) AND k.keys IS NOT NULL
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested, NULL::bigint AS jobs_left,
       NULL::integer AS claims_left
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, s.jobs_left,
       s.claims_left
FROM spent AS s
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       ('{{over}} with ' || (SELECT count(*) FROM claimed) || ' jobs')::bigint, NULL
WHERE (EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM spent))
   OR NOT EXISTS (SELECT 1 FROM room)
ORDER BY due_at, priority, id
