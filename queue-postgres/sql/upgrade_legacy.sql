-- Upgrades a legacy queue table (a pre-lease claim pattern: status + attempts + next_attempt_at,
-- no claim stamp) to the lease schema, in place. Rendered for the table by
-- queue_postgres::upgrade_legacy_sql, with {{queue}} as the default of the queue column (so the
-- legacy rows belong to that queue).
--
-- No backfill of claimed_at: a legacy in_flight row keeps claimed_at NULL, which the claim
-- treats as an expired lease, so rows stranded by the old release are re-claimable at once.

ALTER TABLE "{{table}}"
    ADD COLUMN IF NOT EXISTS claimed_at       timestamptz,
    ADD COLUMN IF NOT EXISTS claim_generation bigint      NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reclaims         integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS queue            text        NOT NULL DEFAULT '{{queue}}',
    ADD COLUMN IF NOT EXISTS payload          jsonb       NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS priority         smallint    NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_error       text,
    ADD COLUMN IF NOT EXISTS unique_key       text,
    ADD COLUMN IF NOT EXISTS created_at       timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS updated_at       timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS finished_at      timestamptz;

CREATE INDEX IF NOT EXISTS "{{table}}_due_idx"
    ON "{{table}}" (queue, next_attempt_at, priority, id) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS "{{table}}_lease_idx"
    ON "{{table}}" (queue, claimed_at NULLS FIRST) WHERE status = 'in_flight';
CREATE UNIQUE INDEX IF NOT EXISTS "{{table}}_unique_idx"
    ON "{{table}}" (queue, unique_key) WHERE unique_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS "{{table}}_finished_idx"
    ON "{{table}}" (finished_at) WHERE finished_at IS NOT NULL;

-- Terminal rows of the legacy table carry no finished_at: stamp them with the upgrade's time, so
-- that the retention sweep reaches them (their retention counts from the upgrade).
UPDATE "{{table}}" SET finished_at = now()
WHERE finished_at IS NULL AND status IN ('completed', 'failed', 'dead', 'cancelled');
