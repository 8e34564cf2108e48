-- Whether a queue is paused, and the stale fences its workers met.
--
-- Parameters: $1 queue. No row, or paused_at NULL: it runs.
SELECT paused_at, stale_fences, last_stale_at FROM "{{table}}_queues" WHERE queue = $1
