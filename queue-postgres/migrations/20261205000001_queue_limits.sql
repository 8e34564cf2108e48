-- Queue limits (queue_core::QueueLimits), kept with the queue's controls and enforced by the
-- claim (claim_limited.sql): max_in_flight, at most so many jobs with a live lease at once;
-- rate_starts per rate_per_ms milliseconds, at most so many claims within any such window
-- (both or neither). rate_log holds the recent claims of a rate-limited queue as
-- [epoch milliseconds, jobs] pairs; claims counts the limited claims that took jobs, so that a
-- claim can tell whether another committed after its snapshot. NULLs and constant defaults:
-- adding them rewrites no row.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS max_in_flight integer CHECK (max_in_flight > 0),
    ADD COLUMN IF NOT EXISTS rate_starts   integer CHECK (rate_starts > 0),
    ADD COLUMN IF NOT EXISTS rate_per_ms   bigint  CHECK (rate_per_ms > 0),
    ADD COLUMN IF NOT EXISTS rate_log      jsonb   NOT NULL DEFAULT '[]',
    ADD COLUMN IF NOT EXISTS claims        bigint  NOT NULL DEFAULT 0;
