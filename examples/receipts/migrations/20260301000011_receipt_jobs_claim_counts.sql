-- The jobs the limited claims put in flight, counted on the controls row (the framework's
-- table migration 20261210000001): a claim that does not take the row's lock until its end
-- bounds the queue's jobs in flight by the jobs the claims that committed meanwhile counted.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS counted_claims bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS counted_jobs bigint NOT NULL DEFAULT 0;
