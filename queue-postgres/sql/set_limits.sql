-- Sets a queue's limits (queue_core::QueueLimits; all NULL: none). The log of recent limited
-- claims is kept: a new rate counts those of them within its window (claims made while the
-- queue had no rate are not in it). The partition cursor is kept too.
--
-- Parameters: $1 queue; $2 max_in_flight (int4, NULL: none); $3 rate_starts (int4); $4
-- rate_per_ms (int8; both NULL: no rate); $5 max_per_partition (int4, NULL: none). Returns the
-- controls after the change.
INSERT INTO "{{table}}_queues" AS c (queue, max_in_flight, rate_starts, rate_per_ms, max_per_partition)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (queue) DO UPDATE
SET max_in_flight = EXCLUDED.max_in_flight,
    rate_starts = EXCLUDED.rate_starts,
    rate_per_ms = EXCLUDED.rate_per_ms,
    max_per_partition = EXCLUDED.max_per_partition,
    updated_at = now()
RETURNING paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms, max_per_partition
