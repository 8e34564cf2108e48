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
tally_claims AS MATERIALIZED (
{{tally_claims}}
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
        -- This release counts room grants (table migration 20261213000001, the fence).
        grants_counted = NOT c.grants_counted,
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
        {{count_tally}},
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
