-- Forgets a recorded schedule (queue_core::Admin::forget_schedule).
--
-- Parameters: $1 queue; $2 the schedule's name. Rows: one when it was recorded.
DELETE FROM "{{table}}_schedules" WHERE queue = $1 AND name = $2 RETURNING name
