-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits, after lock_queue.sql in the same transaction (its
-- first line is claim.sql's, so that a drain finds it running).
--
-- Parameters: claim.sql's $1 to $7 ($2 the batch the claimer asks for).
--
-- Guarantees: claim.sql's, and the queue's limits (queue_core::QueueLimits): at most
-- max_in_flight of the queue's jobs hold a live lease (lease_expires_at not passed, stored by
-- the current claim) once it commits, and at most rate_starts jobs were claimed within any
-- window of rate_per_ms milliseconds. Both counts are read under the queue row's lock, by a
-- statement whose snapshot is younger than the lock, so claims that take turns never count
-- past each other. rate_log holds the recent claims of the queue as [epoch milliseconds, jobs]
-- pairs; this claim drops the ones older than the window and appends its own. The live count
-- reads the in-flight rows of the queue (the lease index), at most max_in_flight of which can
-- be live.
WITH quota AS MATERIALIZED (
    SELECT GREATEST(0, LEAST(
               $2::bigint,
               COALESCE(c.max_in_flight - (
                   SELECT count(*) FROM "{{table}}" AS j
                   WHERE j.queue = $1 AND j.status = 'in_flight'
                     AND j.lease_expires_at >= now() AND j.lease_generation = j.claim_generation
               ), $2::bigint),
               COALESCE(c.rate_starts - (
                   SELECT COALESCE(sum((e ->> 1)::bigint), 0)
                   FROM jsonb_array_elements(c.rate_log) AS e
                   WHERE (e ->> 0)::float8 > extract(epoch FROM now())::float8 * 1000 - c.rate_per_ms
               ), $2::bigint))) AS allowed
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
    UNION ALL
    SELECT $2::bigint WHERE NOT EXISTS (SELECT 1 FROM "{{table}}_queues" WHERE queue = $1)
),
{{claim_picks}},
logged AS (
    UPDATE "{{table}}_queues" AS c
    SET rate_log = COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(c.rate_log) AS e
                             WHERE (e ->> 0)::float8
                                   > extract(epoch FROM now())::float8 * 1000 - c.rate_per_ms), '[]')
                   || jsonb_build_array(jsonb_build_array(
                          round(extract(epoch FROM now())::float8 * 1000), (SELECT count(*) FROM claimed)))
    WHERE c.queue = $1 AND c.rate_starts IS NOT NULL AND EXISTS (SELECT 1 FROM claimed)
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested
FROM claimed
ORDER BY next_attempt_at, priority, id
