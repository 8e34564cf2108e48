-- The end of a claim of a queue with limits (claim_limited.sql and claim_turns.sql render it
-- in place of their claim_logged token, last, after their CTEs control, quota, claimed and
-- next_cursor): the queue's row counts the claim (claims, the rate's log, the tally of the
-- rate per partition) and keeps the partition cursor. With a rate per partition, the jobs the
-- claim took of each partition are logged: in the partition's row of "{{table}}_starts"
-- (keeping the window's entries) when the claim counted per partition, or, while the tally
-- left room for the whole claim (quota.unbound), in one row of "{{table}}_claim_starts" for
-- the whole claim, which fold_starts.sql moves into the partitions' rows once a claim counts
-- per partition again. Every 64th claim deletes up to 100 rows of partitions whose last claim
-- left the window (never one this claim logs: a row is written once per statement) and the
-- rows of "{{table}}_claim_starts" that left it. The rows returned are the claimed jobs (marker
-- NULL), then a row marked 'stale' when the statement's snapshot was stale (it claimed nothing:
-- try again, the lock first), a row marked 'fold' when claims must be folded first (it claimed
-- nothing: fold, then try again), and a row marked 'turns' when {{turns}} holds
-- (claim_limited.sql: its pick would put a partition over its limit, so it claimed nothing;
-- claim_turns.sql claims instead).
key_claims AS (
    SELECT c.partition_key AS key, count(*) AS jobs
    FROM claimed AS c
    WHERE c.partition_key IS NOT NULL AND (SELECT tally_per_ms FROM quota) IS NOT NULL
    GROUP BY c.partition_key
),
key_logged AS (
    INSERT INTO "{{table}}_starts" AS s (queue, partition_key, rate_log, last_at)
    SELECT $1, k.key, jsonb_build_array(jsonb_build_array(q.now_ms, k.jobs)), q.now_at
    FROM key_claims AS k
    CROSS JOIN quota AS q
    WHERE NOT q.unbound
    ON CONFLICT (queue, partition_key) DO UPDATE
    SET rate_log = COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(s.rate_log) AS e
                             WHERE (e ->> 0)::float8
                                   > (SELECT now_ms - tally_per_ms FROM quota)), '[]')
                   || EXCLUDED.rate_log,
        last_at = EXCLUDED.last_at
),
claim_started AS (
    -- The claim's row, numbered by the claims counter it leaves (logged's claims + 1).
    INSERT INTO "{{table}}_claim_starts" (queue, claim, at_ms, keys, jobs)
    SELECT $1, (SELECT claims FROM control) + 1, q.now_ms, array_agg(k.key), array_agg(k.jobs)
    FROM key_claims AS k
    CROSS JOIN quota AS q
    WHERE q.unbound
    GROUP BY q.now_ms
),
claim_starts_pruned AS (
    -- A row whose claim left the window counts for no partition any more, whenever it is read.
    DELETE FROM "{{table}}_claim_starts" AS s
    WHERE s.queue = $1
      AND (SELECT claims FROM control) % 64 = 0
      AND s.at_ms <= (SELECT now_ms - tally_per_ms FROM quota)
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
      AND s.last_at < (SELECT now_at - make_interval(secs => tally_per_ms / 1000.0) FROM quota)
      AND s.partition_key IN (
          SELECT o.partition_key
          FROM "{{table}}_starts" AS o
          WHERE o.queue = $1
            AND o.last_at < (SELECT now_at - make_interval(secs => tally_per_ms / 1000.0)
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
        partition_tally = CASE
            WHEN (SELECT tally_per_ms FROM quota) IS NULL THEN NULL
            WHEN NOT EXISTS (SELECT 1 FROM claimed) THEN c.partition_tally
            ELSE (SELECT CASE
                    -- No tally, or another window length: start again.
                    WHEN (c.partition_tally ->> 'per_ms')::bigint IS DISTINCT FROM q.tally_per_ms
                    THEN jsonb_build_object('per_ms', q.tally_per_ms, 'since', q.now_ms,
                                            'bucket', b.bucket, 'jobs', n.jobs, 'before', 0)
                    -- The clock stepped back: counted in the window the tally is at, never
                    -- forgotten (the claims before the step stay counted when it is put right;
                    -- claim_quota.sql counts per partition until the clock is back there).
                    WHEN b.bucket <= (c.partition_tally ->> 'bucket')::bigint
                    THEN c.partition_tally
                         || jsonb_build_object('jobs', (c.partition_tally ->> 'jobs')::bigint + n.jobs)
                    WHEN b.bucket = (c.partition_tally ->> 'bucket')::bigint + 1
                    THEN c.partition_tally
                         || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs,
                                               'before', (c.partition_tally ->> 'jobs')::bigint)
                    ELSE c.partition_tally
                         || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs, 'before', 0)
                    END
                  FROM quota AS q
                  CROSS JOIN LATERAL (SELECT floor(q.now_ms / q.tally_per_ms)::bigint AS bucket) AS b
                  CROSS JOIN (SELECT count(*) AS jobs FROM claimed
                              WHERE partition_key IS NOT NULL) AS n)
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
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'fold'
WHERE (SELECT bool_or(must_fold AND NOT stale) FROM quota)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'turns'
WHERE {{turns}}
ORDER BY due_at, priority, id
