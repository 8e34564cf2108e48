-- Whether a queue is paused.
--
-- Parameters: $1 queue. No row, or paused_at NULL: it runs.
SELECT paused_at FROM "{{table}}_queues" WHERE queue = $1
