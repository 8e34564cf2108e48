-- The end of a claim of a queue with limits (claim_limited.sql and claim_turns.sql render it
-- in place of their claim_logged token, last, after their CTEs quota, claimed and
-- next_cursor): the queue's row counts the claim (claims, the rate's log) and keeps the
-- partition cursor; with a rate per partition, each partition the claim took jobs of logs them
-- in its row of "{{table}}_starts" (keeping the window's entries), and every 64th claim deletes
-- up to 100 rows of partitions whose last claim left the window (never one this claim logs: a
-- row is written once per statement); the rows returned are the claimed jobs (marker NULL), then a row marked
-- 'stale' when the statement's snapshot was stale (it claimed nothing: try again, the lock
-- first), and a row marked 'turns' when {{turns}} holds (claim_limited.sql: its pick would put
-- a partition over its limit, so it claimed nothing; claim_turns.sql claims instead).
key_claims AS (
    SELECT c.partition_key AS key, count(*) AS jobs
    FROM claimed AS c
    WHERE c.partition_key IS NOT NULL AND (SELECT key_rate_per_ms FROM quota) IS NOT NULL
    GROUP BY c.partition_key
),
key_logged AS (
    INSERT INTO "{{table}}_starts" AS s (queue, partition_key, rate_log, last_at)
    SELECT $1, k.key, jsonb_build_array(jsonb_build_array(q.now_ms, k.jobs)), q.now_at
    FROM key_claims AS k
    CROSS JOIN quota AS q
    ON CONFLICT (queue, partition_key) DO UPDATE
    SET rate_log = COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(s.rate_log) AS e
                             WHERE (e ->> 0)::float8
                                   > (SELECT now_ms - key_rate_per_ms FROM quota)), '[]')
                   || EXCLUDED.rate_log,
        last_at = EXCLUDED.last_at
),
key_pruned AS (
    -- Every 64th limited claim of the queue (by its claims counter), so that the read of the
    -- queue's rows here (by primary key, no index of last_at: that would take the rewrites of
    -- key_logged off the heap-only path) is paid once in many claims. The age is checked on
    -- the row deleted too, not only in the subquery: a row logged since this statement's
    -- snapshot (a stale statement's) is read again as it is now and kept.
    DELETE FROM "{{table}}_starts" AS s
    WHERE s.queue = $1
      AND NOT (SELECT bool_or(stale) FROM quota)
      AND (SELECT claims FROM control) % 64 = 0
      AND s.last_at < (SELECT now_at - make_interval(secs => key_rate_per_ms / 1000.0) FROM quota)
      AND s.partition_key IN (
          SELECT o.partition_key
          FROM "{{table}}_starts" AS o
          WHERE o.queue = $1
            AND o.last_at < (SELECT now_at - make_interval(secs => key_rate_per_ms / 1000.0)
                             FROM quota)
            AND o.partition_key NOT IN (SELECT key FROM key_claims)
          LIMIT 100)
),
logged AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN 1 ELSE 0 END,
        rate_log = CASE WHEN NOT EXISTS (SELECT 1 FROM claimed) THEN c.rate_log
            WHEN c.rate_starts IS NULL OR c.rate_per_ms IS NULL THEN '[]'::jsonb ELSE
            COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(c.rate_log) AS e
                      WHERE (e ->> 0)::float8
                            > extract(epoch FROM clock_timestamp())::float8 * 1000 - c.rate_per_ms),
                     '[]')
            || jsonb_build_array(jsonb_build_array(
                   extract(epoch FROM clock_timestamp())::float8 * 1000, (SELECT count(*) FROM claimed)))
        END,
        partition_cursor = (SELECT key FROM next_cursor)
    WHERE c.queue = $1
      AND (EXISTS (SELECT 1 FROM claimed)
           OR (SELECT key FROM next_cursor) IS DISTINCT FROM c.partition_cursor)
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested, NULL AS marker
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'stale'
WHERE (SELECT bool_or(stale) FROM quota)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'turns'
WHERE {{turns}}
ORDER BY due_at, priority, id
