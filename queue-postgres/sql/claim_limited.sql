-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits (its first line is claim.sql's, so that a drain
-- finds it running).
--
-- Parameters: claim.sql's $1 to $7 ($2 the batch the claimer asks for).
--
-- Guarantees: claim.sql's, and the queue's limits (queue_core::QueueLimits): at most
-- max_in_flight of the queue's jobs in flight once it commits (every in_flight row counts, its
-- lease expired or not: a holder may still renew a lease that has passed, and a takeover of an
-- expired one adds no job, so it is free), at most max_per_partition of one partition's jobs
-- in flight (counted the same way), and at most rate_starts jobs claimed (takeovers included)
-- within any window of rate_per_ms milliseconds, by the database's clock at the moment of
-- counting (clock_timestamp, after the lock). Claims of the queue take turns on its row
-- (control: FOR UPDATE, which returns the row as the last claim to hold it committed it).
-- Every claim that takes a job counts itself in the row's claims; when that count differs from
-- the one this statement's snapshot holds (seen), a claim committed after the snapshot was
-- taken, so the snapshot's counts are stale: the statement claims nothing (its picks take no
-- row) and returns one row whose id is NULL (try again; inside a transaction that took the lock
-- first, lock_queue.sql, it never is). rate_log holds the recent claims as [epoch
-- milliseconds, jobs] pairs; a claim drops the ones older than the window and appends its own.
-- The in-flight counts read the queue's in-flight rows (the lease index). Finalizes the
-- snapshot does not see only make the counts higher. Assumes READ COMMITTED, as every statement
-- of the framework does.
--
-- Partitions (queue_core::partition says the rule; PartitionWalk applies the same one for the
-- other stores). Without max_per_partition the due pick is claim_due.sql's (plain). With it:
-- the due jobs without a partition key, looked for among the queue's {{loose_read_ahead}}
-- earliest due jobs (loose), and the offers of the partitions a walk visits (offers). The walk
-- visits the keys of the queue's pending partitioned jobs in key order, those after the
-- partition cursor first (after_cursor), then from the first key up to the cursor (from_start),
-- one probe each of "{{table}}_partition_idx" that reads the key's earliest job; it stops once
-- as many keys yielded as the claim may take new jobs, or after {{max_visits}} keys. A key
-- yields when its earliest job is due and fewer than max_per_partition of its jobs are in
-- flight (held); it offers its earliest due jobs, up to its room. The earliest of all of these,
-- in claim order, are taken (due), within the quota. The cursor then moves to the last key
-- visited, or stops before the first key that yielded and had nothing taken (logged).
WITH RECURSIVE control AS MATERIALIZED (
    SELECT c.max_in_flight, c.rate_starts, c.rate_per_ms, c.rate_log, c.claims,
           c.max_per_partition, c.partition_cursor
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
           ELSE r.room END AS all_jobs,
           c.max_per_partition AS per_partition,
           c.partition_cursor AS cursor_key
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
    SELECT false, $2::bigint, $2::bigint, NULL::integer, NULL::text
    WHERE NOT EXISTS (SELECT 1 FROM control)
),
plain AS MATERIALIZED (
{{claim_due}}
),
walking AS MATERIALIZED (
    SELECT q.per_partition, q.cursor_key, q.new_jobs
    FROM quota AS q
    WHERE q.per_partition IS NOT NULL AND q.new_jobs > 0
      AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                      WHERE c.queue = $1 AND c.paused_at IS NOT NULL)
),
held AS MATERIALIZED (
    SELECT j.partition_key AS key, count(*) AS n
    FROM "{{table}}" AS j
    WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL
      AND EXISTS (SELECT 1 FROM walking)
    GROUP BY j.partition_key
),
after_cursor (step, key, room, yielded) AS (
    SELECT 1, f.partition_key, r.room, (r.room > 0)::int
    FROM walking AS q
    CROSS JOIN LATERAL (
        (SELECT j.partition_key, j.next_attempt_at
         FROM "{{table}}" AS j
         WHERE q.cursor_key IS NOT NULL AND j.queue = $1 AND j.status = 'pending'
           AND j.partition_key IS NOT NULL AND j.partition_key > q.cursor_key
         ORDER BY j.partition_key, j.next_attempt_at
         LIMIT 1)
        UNION ALL
        (SELECT j.partition_key, j.next_attempt_at
         FROM "{{table}}" AS j
         WHERE q.cursor_key IS NULL AND j.queue = $1 AND j.status = 'pending'
           AND j.partition_key IS NOT NULL
         ORDER BY j.partition_key, j.next_attempt_at
         LIMIT 1)
    ) AS f
    CROSS JOIN LATERAL (
        SELECT CASE WHEN f.next_attempt_at <= now()
               THEN GREATEST(0, q.per_partition - COALESCE(
                        (SELECT h.n FROM held AS h WHERE h.key = f.partition_key), 0))
               ELSE 0 END AS room
    ) AS r
    UNION ALL
    SELECT w.step + 1, f.partition_key, r.room, w.yielded + (r.room > 0)::int
    FROM after_cursor AS w
    CROSS JOIN walking AS q
    CROSS JOIN LATERAL (
        SELECT j.partition_key, j.next_attempt_at
        FROM "{{table}}" AS j
        WHERE j.queue = $1 AND j.status = 'pending' AND j.partition_key IS NOT NULL
          AND j.partition_key > w.key
        ORDER BY j.partition_key, j.next_attempt_at
        LIMIT 1
    ) AS f
    CROSS JOIN LATERAL (
        SELECT CASE WHEN f.next_attempt_at <= now()
               THEN GREATEST(0, q.per_partition - COALESCE(
                        (SELECT h.n FROM held AS h WHERE h.key = f.partition_key), 0))
               ELSE 0 END AS room
    ) AS r
    WHERE w.step < {{max_visits}} AND w.yielded < q.new_jobs
),
from_start (step, key, room, yielded) AS (
    SELECT e.step + 1, f.partition_key, r.room, e.yielded + (r.room > 0)::int
    FROM (SELECT COALESCE(max(step), 0) AS step, COALESCE(max(yielded), 0) AS yielded
          FROM after_cursor) AS e
    CROSS JOIN walking AS q
    CROSS JOIN LATERAL (
        SELECT j.partition_key, j.next_attempt_at
        FROM "{{table}}" AS j
        WHERE j.queue = $1 AND j.status = 'pending' AND j.partition_key IS NOT NULL
          AND j.partition_key <= q.cursor_key
        ORDER BY j.partition_key, j.next_attempt_at
        LIMIT 1
    ) AS f
    CROSS JOIN LATERAL (
        SELECT CASE WHEN f.next_attempt_at <= now()
               THEN GREATEST(0, q.per_partition - COALESCE(
                        (SELECT h.n FROM held AS h WHERE h.key = f.partition_key), 0))
               ELSE 0 END AS room
    ) AS r
    WHERE q.cursor_key IS NOT NULL AND e.step < {{max_visits}} AND e.yielded < q.new_jobs
    UNION ALL
    SELECT w.step + 1, f.partition_key, r.room, w.yielded + (r.room > 0)::int
    FROM from_start AS w
    CROSS JOIN walking AS q
    CROSS JOIN LATERAL (
        SELECT j.partition_key, j.next_attempt_at
        FROM "{{table}}" AS j
        WHERE j.queue = $1 AND j.status = 'pending' AND j.partition_key IS NOT NULL
          AND j.partition_key > w.key AND j.partition_key <= q.cursor_key
        ORDER BY j.partition_key, j.next_attempt_at
        LIMIT 1
    ) AS f
    CROSS JOIN LATERAL (
        SELECT CASE WHEN f.next_attempt_at <= now()
               THEN GREATEST(0, q.per_partition - COALESCE(
                        (SELECT h.n FROM held AS h WHERE h.key = f.partition_key), 0))
               ELSE 0 END AS room
    ) AS r
    WHERE w.step < {{max_visits}} AND w.yielded < q.new_jobs
),
visited AS MATERIALIZED (
    SELECT step, key, room FROM after_cursor
    UNION ALL
    SELECT step, key, room FROM from_start
),
offers AS MATERIALIZED (
    SELECT o.id, o.next_attempt_at, o.priority, o.reclaims, v.key
    FROM visited AS v
    CROSS JOIN walking AS q
    CROSS JOIN LATERAL (
        SELECT j.id, j.next_attempt_at, j.priority, j.reclaims
        FROM "{{table}}" AS j
        WHERE j.queue = $1 AND j.status = 'pending' AND j.partition_key = v.key
          AND j.next_attempt_at <= now()
        ORDER BY j.next_attempt_at, j.priority, j.id
        LIMIT LEAST(v.room, q.new_jobs)
        FOR UPDATE SKIP LOCKED
    ) AS o
    WHERE v.room > 0
),
loose AS MATERIALIZED (
    SELECT j.id, j.next_attempt_at, j.priority, j.reclaims
    FROM "{{table}}" AS j
    WHERE j.id IN (
            SELECT a.id
            FROM (SELECT d.id, d.partition_key
                  FROM "{{table}}" AS d
                  WHERE d.queue = $1 AND d.status = 'pending' AND d.next_attempt_at <= now()
                    AND EXISTS (SELECT 1 FROM walking)
                  ORDER BY d.next_attempt_at, d.priority, d.id
                  LIMIT {{loose_read_ahead}}) AS a
            WHERE a.partition_key IS NULL)
      AND j.status = 'pending'
    ORDER BY j.next_attempt_at, j.priority, j.id
    LIMIT (SELECT new_jobs FROM quota)
    FOR UPDATE OF j SKIP LOCKED
),
due AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, false AS expired
    FROM (SELECT id, next_attempt_at, priority, reclaims FROM plain
          UNION ALL
          SELECT id, next_attempt_at, priority, reclaims FROM loose
          UNION ALL
          SELECT id, next_attempt_at, priority, reclaims FROM offers) AS candidates
    ORDER BY next_attempt_at, priority, id
    LIMIT (SELECT new_jobs FROM quota)
),
{{claim_picks}},
next_cursor AS MATERIALIZED (
    SELECT CASE
           WHEN NOT EXISTS (SELECT 1 FROM visited) THEN (SELECT cursor_key FROM quota)
           WHEN u.step IS NULL THEN (SELECT v.key FROM visited AS v ORDER BY v.step DESC LIMIT 1)
           WHEN u.step = 1 THEN (SELECT cursor_key FROM quota)
           ELSE (SELECT v.key FROM visited AS v WHERE v.step = u.step - 1)
           END AS key
    FROM (SELECT min(v.step) AS step
          FROM visited AS v
          WHERE v.room > 0
            AND NOT EXISTS (SELECT 1 FROM claimed AS c JOIN offers AS o ON o.id = c.id
                            WHERE o.key = v.key)) AS u
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
       payload, taken_over, over_reclaim_cap, cancel_requested
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE (SELECT bool_or(stale) FROM quota)
ORDER BY due_at, priority, id
