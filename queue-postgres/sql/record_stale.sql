-- Counts outcomes of a queue's workers that the fence refused (their worker had lost the job),
-- for operators: queuectl status and the dashboard show them. Written after the fact, best
-- effort, by the worker; the stale path is rare, so is this write.
--
-- Parameters: $1 queue; $2 how many; $3 the switch room_grants of a row it creates
-- (note_served.sql).
INSERT INTO "{{table}}_queues" AS c (queue, stale_fences, last_stale_at, room_grants)
VALUES ($1, $2, now(), $3)
ON CONFLICT (queue) DO UPDATE
SET stale_fences = c.stale_fences + EXCLUDED.stale_fences, last_stale_at = now(),
    updated_at = now()
