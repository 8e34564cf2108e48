-- Upgrades a legacy queue table (a pre-lease claim pattern: status + attempts + next_attempt_at,
-- no claim stamp) to the lease schema: the seed's D1, generalised. Rendered for the configured
-- table by queue_postgres::schema::upgrade_legacy_sql, which puts the table's name in place of
-- "queue_jobs" and its queue's name in the queue column's default.
--
-- No backfill of claimed_at: a legacy in_flight row keeps claimed_at NULL, which the claim
-- treats as an expired lease, so rows stranded by the old release are re-claimable at once.

ALTER TABLE "queue_jobs"
    ADD COLUMN IF NOT EXISTS claimed_at       timestamptz,
    ADD COLUMN IF NOT EXISTS claim_generation bigint      NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reclaims         integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS queue            text        NOT NULL DEFAULT 'default',
    ADD COLUMN IF NOT EXISTS payload          jsonb       NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS priority         smallint    NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_error       text,
    ADD COLUMN IF NOT EXISTS unique_key       text,
    ADD COLUMN IF NOT EXISTS created_at       timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS updated_at       timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS finished_at      timestamptz;

CREATE INDEX IF NOT EXISTS "queue_jobs_due_idx"
    ON "queue_jobs" (queue, next_attempt_at, priority, id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "queue_jobs_lease_idx"
    ON "queue_jobs" (queue, claimed_at NULLS FIRST) WHERE status = 'in_flight';
CREATE UNIQUE INDEX IF NOT EXISTS "queue_jobs_unique_idx"
    ON "queue_jobs" (queue, unique_key) WHERE unique_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS "queue_jobs_finished_idx"
    ON "queue_jobs" (finished_at) WHERE finished_at IS NOT NULL;

-- Terminal rows of the legacy table carry no finished_at: stamp them with the upgrade's time, so
-- that the retention sweep reaches them (their retention counts from the upgrade).
UPDATE "queue_jobs" SET finished_at = now()
WHERE finished_at IS NULL AND status IN ('completed', 'failed', 'dead', 'cancelled');
