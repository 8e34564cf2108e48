-- Sets a queue's limits (queue_core::QueueLimits; all NULL: none). The log of recent limited
-- claims is kept: a new rate counts those of them within its window (claims made while the
-- queue had no rate are not in it). The partition cursor is kept too.
--
-- Parameters: $1 queue; $2 max_in_flight (int4, NULL: none); $3 rate_starts (int4); $4
-- rate_per_ms (int8; both NULL: no rate); $5 max_per_partition (int4, NULL: none); $6
-- partition_rate_starts (int4) and $7 partition_rate_per_ms (int8; both NULL: no rate per
-- partition); $8 the switch room_grants of a row it creates (note_served.sql; a row written
-- before keeps its own). Returns the controls after the change. Without a rate per partition, the
-- partitions' logs of claims are deleted (a rate set later counts from then on), with the
-- claims not yet folded into them and the queue's tally (claim_quota.sql). A rate per partition
-- set where there was none starts its tally complete and empty (no claim before it counts);
-- a change of its starts keeps the tally, and a change of its window makes the next claim start
-- it again. Runs in the transaction of lock_queue.sql, after it, so that its snapshot sees
-- every claim that held the queue's row before (the logs it deletes include theirs). A change
-- moves the claims counter (not counted_claims; limits set as they were move nothing, unless
-- they start the counts per slot again, claim_slots_whole.sql): a claim
-- ahead (claim_ahead.sql) whose snapshot predates it then fails its check, since claims made
-- while the queue had other limits, or none, may not have counted their jobs on the row.
WITH forgotten AS (
    DELETE FROM "{{table}}_starts"
    WHERE queue = $1 AND ($6::integer IS NULL OR $7::bigint IS NULL)
),
forgotten_claims AS (
    DELETE FROM "{{table}}_claim_starts"
    WHERE queue = $1 AND ($6::integer IS NULL OR $7::bigint IS NULL)
)
INSERT INTO "{{table}}_queues" AS c (queue, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
                                     partition_rate_starts, partition_rate_per_ms, partition_tally,
                                     partition_slots, counted_slots, room_grants)
SELECT $1, $2, $3, $4, $5, $6, $7,
       CASE WHEN $6::integer IS NOT NULL AND $7::bigint IS NOT NULL
            THEN jsonb_build_object(
                     'per_ms', $7::bigint, 'since', 0, 'bucket', w.bucket, 'jobs', 0, 'before', 0,
                     'slots_at', w.bucket, 'slots_jobs', 0, 'slot_before', 0)
       END,
       CASE WHEN $6::integer IS NOT NULL AND $7::bigint IS NOT NULL
            THEN array_fill(0, ARRAY[{{slot_count}}])
       END,
       CASE WHEN $5::integer IS NOT NULL THEN array_fill(0::bigint, ARRAY[{{flight_slot_count}}]) END,
       $8::boolean
FROM (SELECT floor(extract(epoch FROM clock_timestamp())::float8 * 1000
                   / $7::bigint)::bigint AS bucket) AS w
ON CONFLICT (queue) DO UPDATE
SET claims = c.claims
             + CASE WHEN (c.max_in_flight, c.rate_starts, c.rate_per_ms, c.max_per_partition,
                          c.partition_rate_starts, c.partition_rate_per_ms)
                         IS DISTINCT FROM
                         (EXCLUDED.max_in_flight, EXCLUDED.rate_starts, EXCLUDED.rate_per_ms,
                          EXCLUDED.max_per_partition, EXCLUDED.partition_rate_starts,
                          EXCLUDED.partition_rate_per_ms)
                         -- Counts per slot started again (below): a claim ahead whose snapshot
                         -- holds the old ones must fail.
                         OR (EXCLUDED.max_per_partition IS NOT NULL AND NOT {{row_slots_whole}})
                    THEN 1 ELSE 0 END,
    -- This release counts room grants (table migration 20261213000001, the fence).
    grants_counted = NOT c.grants_counted,
    max_in_flight = EXCLUDED.max_in_flight,
    rate_starts = EXCLUDED.rate_starts,
    rate_per_ms = EXCLUDED.rate_per_ms,
    max_per_partition = EXCLUDED.max_per_partition,
    partition_rate_starts = EXCLUDED.partition_rate_starts,
    partition_rate_per_ms = EXCLUDED.partition_rate_per_ms,
    partition_tally = CASE WHEN c.partition_rate_starts IS NULL OR c.partition_rate_per_ms IS NULL
                           THEN EXCLUDED.partition_tally
                           WHEN EXCLUDED.partition_tally IS NULL THEN NULL
                           ELSE c.partition_tally END,
    partition_slots = CASE WHEN c.partition_rate_starts IS NULL OR c.partition_rate_per_ms IS NULL
                           THEN EXCLUDED.partition_slots
                           WHEN EXCLUDED.partition_slots IS NULL THEN NULL
                           ELSE c.partition_slots END,
    -- Kept (a running total: claims ahead count from their snapshot's), or started at zeros
    -- where it is not whole (claim_slots_whole.sql), so that the first claims of the limit can
    -- go ahead.
    counted_slots = CASE WHEN EXCLUDED.max_per_partition IS NOT NULL AND NOT {{row_slots_whole}}
                         THEN EXCLUDED.counted_slots
                         ELSE c.counted_slots END,
    updated_at = now()
RETURNING paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
          partition_rate_starts, partition_rate_per_ms, room_grants
