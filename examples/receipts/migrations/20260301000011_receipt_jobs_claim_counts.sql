-- The jobs the limited claims put in flight, counted on the controls row (the framework's
-- table migration 20261210000001): a claim that waited for the row's lock while others
-- committed bounds the queue's jobs in flight without claiming again under the lock.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS counted_claims bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS counted_jobs bigint NOT NULL DEFAULT 0;
