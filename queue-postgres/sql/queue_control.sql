-- Whether a queue is paused, the stale fences its workers met, and its limits.
--
-- Parameters: $1 queue. No row, or paused_at NULL: it runs.
SELECT paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
       partition_rate_starts, partition_rate_per_ms FROM "{{table}}_queues" WHERE queue = $1
