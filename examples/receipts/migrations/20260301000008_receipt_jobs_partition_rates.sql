-- A rate per partition (queue_core::QueueLimits::rate_per_partition): at most
-- partition_rate_starts claims of one partition's jobs within any window of
-- partition_rate_per_ms milliseconds (both, or no rate). NULLs: adding them rewrites no row.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS partition_rate_starts integer CHECK (partition_rate_starts > 0),
    ADD COLUMN IF NOT EXISTS partition_rate_per_ms bigint  CHECK (partition_rate_per_ms > 0);

-- Each partition's recent claims, for its rate: rate_log holds [epoch milliseconds, jobs] pairs
-- within the window, as the queue's own rate_log does; last_at is the last claim logged. Only
-- the claims of a queue with a rate per partition write here, one row per partition they take
-- jobs of; every 64th of them deletes up to 100 rows whose last claim left the window, so the
-- table holds about the partitions claimed within one window. Its rows are rewritten by every
-- claim of their partition: no index but the primary key and half-full pages, so that each
-- rewrite is a heap-only update, pruned within its page without a vacuum.
CREATE TABLE IF NOT EXISTS "receipt_jobs_starts" (
    queue          text        NOT NULL,
    partition_key  text        NOT NULL,
    rate_log       jsonb       NOT NULL DEFAULT '[]',
    last_at        timestamptz NOT NULL,
    PRIMARY KEY (queue, partition_key)
) WITH (fillfactor = 50);
