-- Queue limits (queue_core::QueueLimits), kept with the queue's controls and enforced by the
-- claim: max_in_flight, at most so many jobs with a live lease at once; rate_starts per
-- rate_per_ms milliseconds, at most so many claims within any such window (both or neither).
-- rate_log holds the recent claims of a rate-limited queue as a JSON array of
-- [epoch milliseconds, jobs] pairs.
ALTER TABLE "{{table}}_queues" ADD COLUMN max_in_flight INTEGER CHECK (max_in_flight > 0);
ALTER TABLE "{{table}}_queues" ADD COLUMN rate_starts INTEGER CHECK (rate_starts > 0);
ALTER TABLE "{{table}}_queues" ADD COLUMN rate_per_ms INTEGER CHECK (rate_per_ms > 0);
ALTER TABLE "{{table}}_queues" ADD COLUMN rate_log TEXT NOT NULL DEFAULT '[]';
