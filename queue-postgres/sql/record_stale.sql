-- Counts outcomes of a queue's workers that the fence refused (their worker had lost the job),
-- for operators: queuectl status and the dashboard show them. Written after the fact, best
-- effort, by the worker; the stale path is rare, so is this write.
--
-- Parameters: $1 queue; $2 how many.
INSERT INTO "{{table}}_queues" AS c (queue, stale_fences, last_stale_at)
VALUES ($1, $2, now())
ON CONFLICT (queue) DO UPDATE
SET stale_fences = c.stale_fences + EXCLUDED.stale_fences, last_stale_at = now(),
    updated_at = now()
