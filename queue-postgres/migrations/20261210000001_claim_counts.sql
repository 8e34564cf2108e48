-- The jobs a queue's limited claims put in flight, counted on its controls row, so that a
-- claim whose snapshot predates claims that committed while it ran can still bound the queue's jobs in flight without claiming again under the lock:
-- counted_claims counts the claims that count their jobs here, counted_jobs the jobs they
-- took that were not in flight before (takeovers add none). When every claim since the
-- snapshot counted its jobs (the claims counter moved as far as counted_claims), the
-- snapshot's count of in-flight rows plus the counted jobs since is at least the queue's jobs
-- in flight once the lock is held (claim_ahead.sql); a claim of a release without these
-- columns moves claims alone, and a claim that meets one claims again under the lock.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS counted_claims bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS counted_jobs bigint NOT NULL DEFAULT 0;
