-- A worker starts serving a queue: the admin API lists the queue from now on, even when every
-- job of it has completed (no index leads with queue over completed rows). Written once per
-- worker start, best effort.
--
-- Parameters: $1 queue.
INSERT INTO "{{table}}_queues" AS c (queue, served_at)
VALUES ($1, now())
ON CONFLICT (queue) DO UPDATE SET served_at = now(), updated_at = now()
