-- The framework's queue table on SQLite, and the template for tables of other names
-- (queue_sqlite::create_table_sql): every identifier derived from the table name is written
-- quoted, "{{table}}…", and replaced by the validated name.
--
-- Instants are REAL seconds since the Unix epoch, from SQLite's clock (unixepoch('subsec')),
-- never the worker's. The payload and the error history are JSON text, checked. AUTOINCREMENT:
-- an id is never reused, so a fence (id, generation, token) of a purged job can never match a
-- new one, and keyset pages never meet a recycled id. claim_token is the 64 random bits the
-- claimer drew for the current claim (queue_core::ClaimToken), compared beside the generation
-- by every lease-holder write; 0 until a claim stamps one. STRICT: a value of the wrong type (an instant
-- written as text by hand) is refused at the write, not found out by a claim that never picks it.
-- The schema check refuses a table without AUTOINCREMENT or STRICT.

CREATE TABLE IF NOT EXISTS "{{table}}" (
    id                  INTEGER PRIMARY KEY AUTOINCREMENT,
    queue               TEXT    NOT NULL{{queue_default}},
    status              TEXT    NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'in_flight', 'completed', 'failed', 'dead', 'cancelled')),
    payload             TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(payload)),
    priority            INTEGER NOT NULL DEFAULT 0 CHECK (priority BETWEEN -32768 AND 32767),
    attempts            INTEGER NOT NULL DEFAULT 0 CHECK (attempts BETWEEN 0 AND 2147483647),
    reclaims            INTEGER NOT NULL DEFAULT 0 CHECK (reclaims BETWEEN 0 AND 2147483647),
    next_attempt_at     REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    claimed_at          REAL,
    lease_expires_at    REAL,
    cancel_requested_at REAL,
    claim_generation    INTEGER NOT NULL DEFAULT 0,
    claim_token         INTEGER NOT NULL DEFAULT 0,
    last_error          TEXT,
    unique_key          TEXT,
    created_at          REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    updated_at          REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    finished_at         REAL,
    claimed_by          TEXT,
    errors              TEXT    NOT NULL DEFAULT '[]' CHECK (json_valid(errors))
) STRICT;

-- The due pick of the claim: an ordered scan that stops after the batch.
CREATE INDEX IF NOT EXISTS "{{table}}_due_idx"
    ON "{{table}}" (queue, next_attempt_at, priority, id) WHERE status = 'pending';

-- The expired picks: in-flight rows only, those without a stored lease (NULL) and those whose
-- lease has passed, each a bounded range of this index.
CREATE INDEX IF NOT EXISTS "{{table}}_expiry_idx"
    ON "{{table}}" (queue, lease_expires_at) WHERE status = 'in_flight';

-- Unique keys (the ON CONFLICT target of enqueue).
CREATE UNIQUE INDEX IF NOT EXISTS "{{table}}_unique_idx"
    ON "{{table}}" (queue, unique_key) WHERE unique_key IS NOT NULL;

-- Retention and purges: terminal rows by age.
CREATE INDEX IF NOT EXISTS "{{table}}_finished_idx"
    ON "{{table}}" (finished_at) WHERE finished_at IS NOT NULL;

-- The admin listing of failed, dead and cancelled jobs, newest first.
CREATE INDEX IF NOT EXISTS "{{table}}_failed_idx"
    ON "{{table}}" (queue, status, id) WHERE status IN ('failed', 'dead', 'cancelled');

-- Queue controls: pauses, the stale fences workers met, the queues workers served.
CREATE TABLE IF NOT EXISTS "{{table}}_queues" (
    queue         TEXT    PRIMARY KEY,
    paused_at     REAL,
    stale_fences  INTEGER NOT NULL DEFAULT 0,
    last_stale_at REAL,
    served_at     REAL,
    updated_at    REAL    NOT NULL DEFAULT (unixepoch('subsec'))
) STRICT;
