-- Partitions and recorded schedules. Partitions (queue_core::NewJob::partition_key,
-- QueueLimits::max_per_partition): a job's
-- partition key; a queue's limit of jobs in flight per partition, and the key where its last
-- limited claim stopped (partitions take turns from there: queue_core::partition). NULLs:
-- adding them rewrites no row.
ALTER TABLE "{{table}}" ADD COLUMN IF NOT EXISTS partition_key text;

ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS max_per_partition integer CHECK (max_per_partition > 0),
    ADD COLUMN IF NOT EXISTS partition_cursor  text;

-- The walk over a queue's partitions (one probe per key, the key's earliest job first) and each
-- partition's due pick. Only jobs with a partition key: empty for a table that has none.
CREATE INDEX IF NOT EXISTS "{{table}}_partition_idx"
    ON "{{table}}" (queue, partition_key, next_attempt_at, priority, id)
    WHERE status = 'pending' AND partition_key IS NOT NULL;

-- The schedules schedulers run on each queue, as the last to pass reported them
-- (queue_core::Admin::record_schedules), for operators: when the periods fall (spec), what
-- happens to missed ones, the latest period handled (never going back), the next, and who
-- reported when, by the database's clock.
CREATE TABLE IF NOT EXISTS "{{table}}_schedules" (
    queue    text        NOT NULL,
    name     text        NOT NULL,
    spec     text        NOT NULL,
    missed   text        NOT NULL,
    through  timestamptz,
    next_at  timestamptz,
    seen_at  timestamptz NOT NULL DEFAULT now(),
    seen_by  text        NOT NULL,
    PRIMARY KEY (queue, name)
);
