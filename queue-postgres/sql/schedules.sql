-- The schedules recorded for a queue (record_schedules.sql), by name.
--
-- Parameters: $1 queue.
SELECT name, spec, missed, through, next_at, seen_at, seen_by
FROM "{{table}}_schedules"
WHERE queue = $1
ORDER BY name
