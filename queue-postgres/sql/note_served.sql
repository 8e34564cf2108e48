-- A worker starts serving a queue: the admin API lists the queue from now on, even when every
-- job of it has completed (no index leads with queue over completed rows). Written once per
-- worker start, best effort.
--
-- Parameters: $1 queue; $2 the switch room_grants of a row it creates (PgQueueConfig's
-- room_grants_for_new_queues; a row written before keeps its own).
INSERT INTO "{{table}}_queues" AS c (queue, served_at, room_grants)
VALUES ($1, now(), $2)
ON CONFLICT (queue) DO UPDATE SET served_at = now(), updated_at = now()
