-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits (its first line is claim.sql's, so that a drain
-- finds it running).
--
-- Parameters: claim.sql's $1 to $7 ($2 the batch the claimer asks for).
--
-- Guarantees: claim.sql's, and the queue's limits (queue_core::QueueLimits): at most
-- max_in_flight of the queue's jobs in flight once it commits (every in_flight row counts, its
-- lease expired or not: a holder may still renew a lease that has passed, and a takeover of an
-- expired one adds no job, so it is free), and at most rate_starts jobs claimed (takeovers
-- included) within any window of rate_per_ms milliseconds, by the database's clock at the
-- moment of counting (clock_timestamp, after the lock). Claims of the queue take turns on its
-- row (control: FOR UPDATE, which returns the row as the last claim to hold it committed it).
-- Every claim that takes a job counts itself in the row's claims; when that count differs from
-- the one this statement's snapshot holds (seen), a claim committed after the snapshot was
-- taken, so the snapshot's counts are stale: the statement claims nothing (its picks take no
-- row) and returns one row whose id is NULL (try again; inside a transaction that took the lock
-- first, lock_queue.sql, it never is). rate_log holds the recent claims as [epoch
-- milliseconds, jobs] pairs; a claim drops the ones older than the window and appends its own.
-- The in-flight count reads the queue's in-flight rows (the lease index). Finalizes the
-- snapshot does not see only make the count higher. Assumes READ COMMITTED, as every statement
-- of the framework does.
WITH control AS MATERIALIZED (
    SELECT c.max_in_flight, c.rate_starts, c.rate_per_ms, c.rate_log, c.claims
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
    FOR UPDATE
),
seen AS MATERIALIZED (
    SELECT claims FROM "{{table}}_queues" WHERE queue = $1
),
quota AS MATERIALIZED (
    SELECT c.claims IS DISTINCT FROM (SELECT claims FROM seen) AS stale,
           CASE WHEN c.claims IS DISTINCT FROM (SELECT claims FROM seen) THEN 0
           ELSE LEAST(GREATEST(0, COALESCE(c.max_in_flight - (
                    SELECT count(*) FROM "{{table}}" AS j
                    WHERE j.queue = $1 AND j.status = 'in_flight'), $2::bigint)),
                    r.room)
           END AS new_jobs,
           CASE WHEN c.claims IS DISTINCT FROM (SELECT claims FROM seen) THEN 0
           ELSE r.room END AS all_jobs
    FROM control AS c
    CROSS JOIN LATERAL (
        SELECT CASE WHEN c.rate_starts IS NULL OR c.rate_per_ms IS NULL THEN $2::bigint
               ELSE GREATEST(0, LEAST($2::bigint, c.rate_starts - (
                   SELECT COALESCE(sum((e ->> 1)::bigint), 0)
                   FROM jsonb_array_elements(c.rate_log) AS e
                   WHERE (e ->> 0)::float8
                         > extract(epoch FROM clock_timestamp())::float8 * 1000 - c.rate_per_ms)))
               END AS room
    ) AS r
    UNION ALL
    SELECT false, $2::bigint, $2::bigint WHERE NOT EXISTS (SELECT 1 FROM control)
),
{{claim_picks}},
logged AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + 1,
        rate_log = CASE WHEN c.rate_starts IS NULL OR c.rate_per_ms IS NULL THEN '[]'::jsonb ELSE
            COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(c.rate_log) AS e
                      WHERE (e ->> 0)::float8
                            > extract(epoch FROM clock_timestamp())::float8 * 1000 - c.rate_per_ms),
                     '[]')
            || jsonb_build_array(jsonb_build_array(
                   extract(epoch FROM clock_timestamp())::float8 * 1000, (SELECT count(*) FROM claimed)))
        END
    WHERE c.queue = $1 AND EXISTS (SELECT 1 FROM claimed)
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE (SELECT bool_or(stale) FROM quota)
ORDER BY due_at, priority, id
