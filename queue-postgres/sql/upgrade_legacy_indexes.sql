-- The legacy upgrade, phase 3 of 4: the lease schema's indexes, each built CONCURRENTLY (one
-- statement each, outside any transaction): readers and writers go on; the build waits for the
-- transactions already running on the table and scans it twice. A build that fails leaves an
-- INVALID index behind, which the runner drops (DROP INDEX CONCURRENTLY) and builds again, and
-- which the start-up schema check refuses.
--
-- The same definitions as the table migrations' (a test compares them with a table created by
-- create_table_sql). One statement per paragraph; each names its index first.

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_due_idx"
    ON "{{table}}" (queue, next_attempt_at, priority, id) WHERE status = 'pending';

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_lease_idx"
    ON "{{table}}" (queue, claimed_at NULLS FIRST) WHERE status = 'in_flight';

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_expiry_idx"
    ON "{{table}}" (queue, lease_expires_at NULLS FIRST) WHERE status = 'in_flight';

CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_unique_idx"
    ON "{{table}}" (queue, unique_key) WHERE unique_key IS NOT NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_finished_idx"
    ON "{{table}}" (finished_at) WHERE finished_at IS NOT NULL;

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_failed_idx"
    ON "{{table}}" (queue, status, id) WHERE status IN ('failed', 'dead', 'cancelled');

CREATE INDEX CONCURRENTLY IF NOT EXISTS "{{table}}_partition_idx"
    ON "{{table}}" (queue, partition_key, next_attempt_at, priority, id)
    WHERE status = 'pending' AND partition_key IS NOT NULL;
