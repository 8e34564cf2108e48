-- Pauses a queue (resumes it when $2 is false): no claim takes its jobs while paused_at is set.
-- Pausing a paused queue keeps its first paused_at.
--
-- Parameters: $1 queue; $2 true to pause, false to resume; $3 the switch room_grants of a row
-- it creates (note_served.sql). Returns paused_at after the change.
INSERT INTO "{{table}}_queues" AS c (queue, paused_at, room_grants)
VALUES ($1, CASE WHEN $2 THEN now() END, $3)
ON CONFLICT (queue) DO UPDATE
SET paused_at = CASE WHEN $2 THEN coalesce(c.paused_at, now()) END, updated_at = now()
RETURNING paused_at, stale_fences, last_stale_at, max_in_flight, rate_starts, rate_per_ms, max_per_partition,
          partition_rate_starts, partition_rate_per_ms, room_grants
