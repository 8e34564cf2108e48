-- Partitions (queue_core::NewJob::partition_key, QueueLimits::max_per_partition): a job's
-- partition key; a queue's limit of jobs in flight per partition, and the key where its last
-- limited claim stopped (partitions take turns from there: queue_core::partition).
ALTER TABLE "{{table}}" ADD COLUMN partition_key TEXT;
ALTER TABLE "{{table}}_queues" ADD COLUMN max_per_partition INTEGER CHECK (max_per_partition > 0);
ALTER TABLE "{{table}}_queues" ADD COLUMN partition_cursor TEXT;

-- The walk over a queue's partitions (one probe per key, the key's earliest job first) and each
-- partition's due pick. Only jobs with a partition key: empty for a table that has none.
CREATE INDEX IF NOT EXISTS "{{table}}_partition_idx"
    ON "{{table}}" (queue, partition_key, next_attempt_at, priority, id)
    WHERE status = 'pending' AND partition_key IS NOT NULL;
