-- Folds the claims a queue made while its tally left room for whole claims (one row each in
-- "{{table}}_claim_starts", claim_logged.sql) into its partitions' logs of claims
-- ("{{table}}_starts"), so that a claim counting per partition sees every start within the
-- window: each claim's jobs of a partition become one [epoch milliseconds, jobs] entry of that
-- partition's log, at the claim's instant; the claims' rows are deleted, those older than the
-- window too (they count for nothing). Runs in the transaction of lock_queue.sql, after it, so
-- that no claim of the queue comes between its read and its write (claim_limited.sql returns a
-- row marked 'fold' when a claim needs it).
--
-- Parameters: $1 queue. Returns nothing.
WITH batches AS (
    DELETE FROM "{{table}}_claim_starts"
    WHERE queue = $1
    RETURNING at_ms, keys, jobs
),
entries AS (
    SELECT u.key,
           jsonb_agg(jsonb_build_array(b.at_ms, u.jobs) ORDER BY b.at_ms) AS rate_log,
           max(b.at_ms) AS last_ms
    FROM batches AS b
    CROSS JOIN LATERAL unnest(b.keys, b.jobs) AS u (key, jobs)
    WHERE b.at_ms > extract(epoch FROM clock_timestamp())::float8 * 1000 - (
              SELECT c.partition_rate_per_ms FROM "{{table}}_queues" AS c WHERE c.queue = $1)
    GROUP BY u.key
)
INSERT INTO "{{table}}_starts" AS s (queue, partition_key, rate_log, last_at)
SELECT $1, e.key, e.rate_log, to_timestamp(e.last_ms / 1000)
FROM entries AS e
ON CONFLICT (queue, partition_key) DO UPDATE
SET rate_log = s.rate_log || EXCLUDED.rate_log,
    last_at = GREATEST(s.last_at, EXCLUDED.last_at)
