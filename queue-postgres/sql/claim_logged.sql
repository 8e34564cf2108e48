-- The end of a claim of a queue with limits (claim_limited.sql and claim_turns.sql render it
-- in place of their claim_logged token, last, after their CTEs quota, claimed and
-- next_cursor): the queue's row counts the claim (claims, the rate's log) and keeps the
-- partition cursor; the rows returned are the claimed jobs (marker NULL), then a row marked
-- 'stale' when the statement's snapshot was stale (it claimed nothing: try again, the lock
-- first), and a row marked 'turns' when {{turns}} holds (claim_limited.sql: its pick would put
-- a partition over its limit, so it claimed nothing; claim_turns.sql claims instead).
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
