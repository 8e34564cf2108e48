-- A rate per partition (queue_core::QueueLimits::rate_per_partition): at most
-- partition_rate_starts claims of one partition's jobs within any window of
-- partition_rate_per_ms milliseconds (both or neither), takeovers of expired leases included.
ALTER TABLE "{{table}}_queues" ADD COLUMN partition_rate_starts INTEGER CHECK (partition_rate_starts > 0);
ALTER TABLE "{{table}}_queues" ADD COLUMN partition_rate_per_ms INTEGER CHECK (partition_rate_per_ms > 0);

-- Each partition's recent claims, for its rate: rate_log holds [epoch milliseconds, jobs] pairs
-- within the window, as the queue's own rate_log does; last_at is the last claim logged, by
-- SQLite's clock. Only the claims of a queue with a rate per partition write here, one row per
-- partition they take jobs of, and they delete the rows whose last claim left the window
-- (through the index), so the table holds about the partitions claimed within one window.
CREATE TABLE IF NOT EXISTS "{{table}}_starts" (
    queue         TEXT NOT NULL,
    partition_key TEXT NOT NULL,
    rate_log      TEXT NOT NULL DEFAULT '[]' CHECK (json_valid(rate_log)),
    last_at       REAL NOT NULL,
    PRIMARY KEY (queue, partition_key)
) STRICT;

CREATE INDEX IF NOT EXISTS "{{table}}_starts_idx"
    ON "{{table}}_starts" (queue, last_at);
