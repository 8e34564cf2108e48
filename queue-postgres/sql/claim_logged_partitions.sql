-- The per-partition logging of a claim of a queue with limits (claim_logged.sql renders it in
-- place of its partition_logs token, and says what it logs; the lean form of
-- claim_limited.sql, for a queue without limits per partition, renders nothing).
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
    WHERE NOT (SELECT unbound FROM rated)
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
    WHERE (SELECT unbound FROM rated)
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
