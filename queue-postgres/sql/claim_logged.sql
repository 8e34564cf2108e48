-- The end of a claim of a queue with limits (claim_limited.sql and claim_turns.sql render it
-- in place of their claim_logged token, last, after their CTEs control, quota, claimed and
-- next_cursor): the queue's row counts the claim (claims, the jobs it put in flight, per slot
-- of partition keys too with max_per_partition, the rate's log, the tally of the rate per
-- partition) and keeps the partition cursor. With a rate per partition, the jobs the
-- claim took of each partition are logged: in the partition's row of "{{table}}_starts"
-- (keeping the window's entries) when the claim counted per partition, or, while the tally
-- left room for the whole claim (rated.unbound, claim_rated.sql), in one row of "{{table}}_claim_starts" for
-- the whole claim, which fold_starts.sql moves into the partitions' rows once a claim counts
-- per partition again. Every 64th claim deletes up to 100 rows of partitions whose last claim
-- left the window (never one this claim logs: a row is written once per statement) and the
-- rows of "{{table}}_claim_starts" that left it. The rows returned are the claimed jobs (marker
-- NULL), then a row marked 'stale' when the statement's snapshot was stale (it claimed nothing:
-- try again, the lock first), a row marked 'fold' when claims must be folded first (it claimed
-- nothing: fold, then try again), a row marked 'turns' when {{turns}} holds
-- (claim_limited.sql: its pick would put a partition over its limit, so it claimed nothing;
-- claim_turns.sql claims instead), and a row marked 'partitioned' when the lean form of
-- claim_limited.sql met a queue with limits per partition (it claimed nothing: claim with the
-- full form). The per-partition logging is claim_logged_partitions.sql, rendered in place of
-- the partition_logs token (nothing in the lean form).
{{partition_logs}}
slot_claims AS (
    -- The claim's partitioned jobs per slot of their keys (claim_slot.sql), for the tally per
    -- slot (read only when the claim counts in it: a CTE nobody reads never runs).
    SELECT {{slot}} AS slot, count(*)::integer AS jobs
    FROM claimed AS c
    WHERE c.partition_key IS NOT NULL AND (SELECT tally_per_ms FROM quota) IS NOT NULL
    GROUP BY 1
),
flight_claims AS (
    -- The claim's new partitioned jobs (takeovers were in flight already) per slot of the
    -- counts of jobs put in flight, all slots in order (claim_slot.sql, counted_slots: read
    -- only with max_per_partition).
    SELECT array_agg(COALESCE(k.jobs, 0)::bigint ORDER BY i) AS jobs
    FROM generate_series(1, {{flight_slot_count}}) AS i
    LEFT JOIN (SELECT {{flight_slot}} AS slot, count(*) AS jobs
               FROM claimed AS c
               WHERE NOT c.taken_over AND c.partition_key IS NOT NULL
               GROUP BY 1) AS k ON k.slot + 1 = i
),
logged AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN 1 ELSE 0 END,
        counted_claims = c.counted_claims
                         + CASE WHEN EXISTS (SELECT 1 FROM claimed) THEN 1 ELSE 0 END,
        counted_jobs = c.counted_jobs + (SELECT count(*) FROM claimed WHERE NOT taken_over),
        {{count_slots}},
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
                                            'bucket', b.bucket, 'jobs', n.jobs, 'before', 0,
                                            'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                            'slot_before', 0)
                    -- The clock stepped back: counted in the window the tally is at, never
                    -- forgotten (the claims before the step stay counted when it is put right;
                    -- claim_quota.sql counts per partition until the clock is back there).
                    -- The slots count the claim unless the tally's sum left room for it.
                    WHEN b.bucket <= (c.partition_tally ->> 'bucket')::bigint
                    THEN c.partition_tally
                         || jsonb_build_object('jobs', (c.partition_tally ->> 'jobs')::bigint + n.jobs)
                         || CASE WHEN q.slots_kept AND NOT q.unbound
                                 THEN jsonb_build_object(
                                          'slots_jobs',
                                          (c.partition_tally ->> 'slots_jobs')::bigint + n.jobs)
                                 ELSE '{}' END
                    -- The next window: the tally's becomes the one before.
                    WHEN b.bucket = (c.partition_tally ->> 'bucket')::bigint + 1
                    THEN c.partition_tally
                         || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs,
                                               'before', (c.partition_tally ->> 'jobs')::bigint,
                                               'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                               'slot_before', CASE WHEN q.slots_kept
                                                   THEN (SELECT COALESCE(max(e), 0)
                                                         FROM unnest(c.partition_slots) AS e)
                                                        + (c.partition_tally ->> 'jobs')::bigint
                                                        - (c.partition_tally ->> 'slots_jobs')::bigint
                                                   ELSE (c.partition_tally ->> 'jobs')::bigint
                                                   END)
                    ELSE c.partition_tally
                         || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs, 'before', 0,
                                               'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                               'slot_before', 0)
                    END
                  FROM quota AS q
                  CROSS JOIN LATERAL (SELECT floor(q.now_ms / q.tally_per_ms)::bigint AS bucket) AS b
                  CROSS JOIN (SELECT count(*) AS jobs FROM claimed
                              WHERE partition_key IS NOT NULL) AS n)
        END,
        -- Rewritten whole (512 counts) when the claim counts in them: not while the tally's sum
        -- left room for the claim (its jobs then stay untracked, charged to every slot), which
        -- keeps a queue far under its rate from paying for them. In the tally's window (or
        -- behind it) the counts go on; a new window, or a new tally, starts from this claim's.
        partition_slots = CASE
            WHEN (SELECT tally_per_ms FROM quota) IS NULL THEN NULL
            WHEN NOT EXISTS (SELECT 1 FROM claimed) THEN c.partition_slots
            ELSE (SELECT CASE
                    WHEN w.same AND NOT q.slots_kept THEN NULL
                    WHEN w.same AND q.unbound THEN c.partition_slots
                    ELSE (SELECT array_agg(COALESCE(CASE WHEN w.same THEN c.partition_slots[i] END, 0)
                                           + COALESCE(a.jobs, 0)
                                           ORDER BY i)
                          FROM generate_series(1, {{slot_count}}) AS i
                          LEFT JOIN slot_claims AS a ON a.slot + 1 = i)
                    END
                  FROM quota AS q
                  CROSS JOIN LATERAL (
                      SELECT (c.partition_tally ->> 'per_ms')::bigint IS NOT DISTINCT FROM q.tally_per_ms
                             AND floor(q.now_ms / q.tally_per_ms)::bigint
                                 <= (c.partition_tally ->> 'bucket')::bigint AS same) AS w)
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
WHERE (SELECT bool_or(must_fold) FROM rated) AND NOT (SELECT bool_or(stale) FROM quota)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'turns'
WHERE {{turns}}
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'partitioned'
WHERE (SELECT bool_or(refused AND NOT stale) FROM quota)
ORDER BY due_at, priority, id
