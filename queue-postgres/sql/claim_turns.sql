-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue whose partitions take turns: claim_limited.sql's pick would have
-- put a partition over max_per_partition (queue_core::partition says the rule; fits and
-- PartitionWalk apply the same one for the other stores). Its first line is claim.sql's, so that
-- a drain finds it running.
--
-- Parameters: claim.sql's $1 to $7. Guarantees: claim_limited.sql's.
--
-- The due jobs are the jobs without a partition key, looked for among the queue's earliest due
-- jobs (eight times the claim's new jobs, at most {{loose_read_ahead}}: loose), and the offers of
-- the partitions a walk visits (offers). The walk visits the keys of the queue's pending
-- partitioned jobs in key order, those after the partition cursor first (after_cursor), then
-- from the first key up to the cursor (from_start), one probe each of
-- "{{table}}_partition_idx" that reads the key's earliest job; it stops once as many keys
-- yielded as the claim may take new jobs, or after {{max_visits}} keys. A key yields when its
-- earliest job is due and it has room (claim_walk_room.sql: fewer than max_per_partition of its
-- jobs in flight, and starts left by its rate per partition); it offers its earliest due jobs,
-- up to its room. The earliest of all of
-- these, in claim order, are locked within the quota (locked: FOR UPDATE SKIP LOCKED, the status
-- and due time read again, as claim_due.sql's pick does; a row another transaction holds is
-- passed over and the next one taken), and merged with the takeovers of expired leases in claim
-- order (claim_picks.sql). The cursor then moves to the last key visited, or stops before the
-- first key that yielded and had nothing taken because earlier jobs filled the batch
-- (next_cursor; a key whose offers were locked by others does not keep its turn).
WITH RECURSIVE {{claim_quota}},
{{rated}},
walking AS MATERIALIZED (
    SELECT q.per_partition, q.cursor_key, q.new_jobs, q.key_rate_starts
    FROM quota AS q
    WHERE q.partitioned AND q.new_jobs > 0
      AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                      WHERE c.queue = $1 AND c.paused_at IS NOT NULL)
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
    CROSS JOIN LATERAL ({{walk_room}}) AS r
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
    CROSS JOIN LATERAL ({{walk_room}}) AS r
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
    CROSS JOIN LATERAL ({{walk_room}}) AS r
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
    CROSS JOIN LATERAL ({{walk_room}}) AS r
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
                  LIMIT LEAST({{loose_read_ahead}}, 8 * (SELECT new_jobs FROM walking))) AS a
            WHERE a.partition_key IS NULL)
    ORDER BY j.next_attempt_at, j.priority, j.id
    LIMIT (SELECT new_jobs FROM quota)
),
locked AS MATERIALIZED (
    SELECT j.id, j.next_attempt_at, j.priority, j.reclaims, j.partition_key
    FROM "{{table}}" AS j
    -- By primary key: the candidates are few, whatever the planner thinks of the backlog.
    WHERE j.id = ANY (ARRAY(SELECT id FROM loose UNION ALL SELECT id FROM offers))
      AND j.status = 'pending' AND j.next_attempt_at <= now()
    ORDER BY j.next_attempt_at, j.priority, j.id
    LIMIT (SELECT new_jobs FROM quota)
    FOR UPDATE OF j SKIP LOCKED
),
due AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, false AS expired, partition_key
    FROM locked
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
                            WHERE o.key = v.key)
            -- It lost to earlier jobs (its earliest offer sorts after the last job claimed),
            -- not to a lock another transaction held: a locked offer does not hold the turn.
            AND (SELECT ROW(o.next_attempt_at, o.priority, o.id) FROM offers AS o
                 WHERE o.key = v.key
                 ORDER BY o.next_attempt_at, o.priority, o.id LIMIT 1)
                > (SELECT ROW(c.next_attempt_at, c.priority, c.id) FROM claimed AS c
                   ORDER BY c.next_attempt_at DESC, c.priority DESC, c.id DESC LIMIT 1)) AS u
),
{{claim_logged}}
