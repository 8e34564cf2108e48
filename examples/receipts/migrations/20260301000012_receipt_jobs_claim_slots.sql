-- The jobs the limited claims put in flight per slot of partition keys, on the controls row
-- (the framework's table migration 20261211000001): a claim that waited for the row's lock
-- while others committed bounds each partition's jobs in flight without claiming again under
-- the lock.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS counted_slots bigint[],
    ADD COLUMN IF NOT EXISTS slotted_claims bigint NOT NULL DEFAULT 0;

ALTER TABLE "receipt_jobs_queues"
    ALTER COLUMN counted_slots SET STORAGE PLAIN;
