-- Whether a queue is paused, the stale fences its workers met, its limits, and whether room
-- may be granted to its queue handles (room_grants, the switch its row started with or the
-- operator's since: grant.sql).
--
-- Parameters: $1 queue. No row, or paused_at NULL: it runs.
SELECT paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
       partition_rate_starts, partition_rate_per_ms, room_grants FROM "{{table}}_queues" WHERE queue = $1
