-- The legacy upgrade, phase 1 of 4: the lease schema's columns, added to a legacy queue table (a
-- pre-lease claim pattern: status + attempts + next_attempt_at, no claim stamp) in place.
-- Rendered by queue_postgres::LegacyUpgrade, with {{queue}} as the queue column's default (rows
-- the legacy release goes on inserting without it belong to that queue).
--
-- Catalog-only: every default is a constant or now() (stable, evaluated once), so no row is
-- rewritten, but the ALTER takes ACCESS EXCLUSIVE, which blocks readers and writers while it
-- waits for the lock. The runner sets a short lock_timeout and tries again; the statement is
-- over in milliseconds once it has the lock. Re-runnable (IF NOT EXISTS).
--
-- No backfill of claimed_at: a legacy in_flight row keeps claimed_at NULL, which the claim
-- treats as an expired lease, so rows stranded by the old release are re-claimable at once.
-- The columns of every later table migration up to 20261211000001 are here too; the later
-- ones follow this file in the phase, rendered as they are (LegacyUpgrade::steps), so the
-- table ends on the current lease schema (a test compares it with a table created by
-- create_table_sql).
ALTER TABLE "{{table}}"
    ADD COLUMN IF NOT EXISTS claimed_at          timestamptz,
    ADD COLUMN IF NOT EXISTS claim_generation    bigint      NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS claim_token         bigint      NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS reclaims            integer     NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS queue               text        NOT NULL DEFAULT '{{queue}}',
    ADD COLUMN IF NOT EXISTS payload             jsonb       NOT NULL DEFAULT '{}',
    ADD COLUMN IF NOT EXISTS priority            smallint    NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS last_error          text,
    ADD COLUMN IF NOT EXISTS unique_key          text,
    ADD COLUMN IF NOT EXISTS created_at          timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS updated_at          timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS finished_at         timestamptz,
    ADD COLUMN IF NOT EXISTS lease_expires_at    timestamptz,
    ADD COLUMN IF NOT EXISTS lease_generation    bigint,
    ADD COLUMN IF NOT EXISTS cancel_requested_at timestamptz,
    ADD COLUMN IF NOT EXISTS claimed_by          text,
    ADD COLUMN IF NOT EXISTS errors              jsonb       NOT NULL DEFAULT '[]',
    ADD COLUMN IF NOT EXISTS partition_key       text;

-- The queue controls (pauses), a table of their own: creating it takes no lock on the job table.
CREATE TABLE IF NOT EXISTS "{{table}}_queues" (
    queue         text        PRIMARY KEY,
    paused_at     timestamptz,
    stale_fences  bigint      NOT NULL DEFAULT 0,
    last_stale_at timestamptz,
    served_at     timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

-- The queue limits (table migration 20261205000001), on a controls table of any age.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS max_in_flight integer CHECK (max_in_flight > 0),
    ADD COLUMN IF NOT EXISTS rate_starts   integer CHECK (rate_starts > 0),
    ADD COLUMN IF NOT EXISTS rate_per_ms   bigint  CHECK (rate_per_ms > 0),
    ADD COLUMN IF NOT EXISTS rate_log      jsonb   NOT NULL DEFAULT '[]',
    ADD COLUMN IF NOT EXISTS claims        bigint  NOT NULL DEFAULT 0;

-- The partitions' controls (table migration 20261206000001), on a controls table of any age.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS max_per_partition integer CHECK (max_per_partition > 0),
    ADD COLUMN IF NOT EXISTS partition_cursor  text;

-- The recorded schedules (table migration 20261206000001): a table of its own.
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

-- The partition rates (table migration 20261207000001): the columns, and the partitions' logs
-- of claims in a table of their own.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_rate_starts integer CHECK (partition_rate_starts > 0),
    ADD COLUMN IF NOT EXISTS partition_rate_per_ms bigint  CHECK (partition_rate_per_ms > 0);

CREATE TABLE IF NOT EXISTS "{{table}}_starts" (
    queue          text        NOT NULL,
    partition_key  text        NOT NULL,
    rate_log       jsonb       NOT NULL DEFAULT '[]',
    last_at        timestamptz NOT NULL,
    PRIMARY KEY (queue, partition_key)
) WITH (fillfactor = 50);

-- The tally of the rate per partition (table migration 20261208000001): a column, and the
-- claims not yet folded into the partitions' logs in a table of their own.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_tally jsonb;

CREATE TABLE IF NOT EXISTS "{{table}}_claim_starts" (
    queue  text     NOT NULL,
    claim  bigint   NOT NULL,
    at_ms  float8   NOT NULL,
    keys   text[]   NOT NULL,
    jobs   bigint[] NOT NULL,
    PRIMARY KEY (queue, claim)
);

-- The tally per slot of partition keys (table migration 20261209000001).
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_slots integer[];

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN partition_slots SET STORAGE PLAIN;

ALTER TABLE "{{table}}_queues" SET (toast_tuple_target = 8160);

-- The jobs the limited claims put in flight (table migration 20261210000001).
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS counted_claims bigint NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS counted_jobs bigint NOT NULL DEFAULT 0;

-- The jobs the limited claims put in flight per slot of partition keys (table migration
-- 20261211000001).
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS counted_slots bigint[],
    ADD COLUMN IF NOT EXISTS slotted_claims bigint NOT NULL DEFAULT 0;

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN counted_slots SET STORAGE PLAIN
