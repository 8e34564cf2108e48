-- The holder, the error history and the queue controls of the admin API.
--
-- claimed_by is who holds (or last held) a job: the claimer's name, stamped by every claim.
-- errors is the job's last errors (queue_core::limits::ERROR_HISTORY_LEN of them), oldest first,
-- each {attempt, generation, at, worker, outcome, error}: finalize.sql appends one for every
-- fail, retry, cancel and dead outcome it applies. Both come with constant defaults, so adding
-- them rewrites no row.
--
-- "{{table}}_queues" holds one row per queue an operator paused, that a worker served, or whose
-- workers met a stale fence: while paused_at is set, no claim takes a job of that queue;
-- served_at is when a worker last started on it (so the admin API lists it even when every job
-- completed); stale_fences counts the outcomes its workers wrote after losing the job (the
-- fence refused them), for operators. The failed index serves the operator's listing of failed,
-- dead and cancelled jobs, newest first: it holds those rows only, so workers never write to it
-- on the hot path.

ALTER TABLE "{{table}}"
    ADD COLUMN IF NOT EXISTS claimed_by text,
    ADD COLUMN IF NOT EXISTS errors     jsonb NOT NULL DEFAULT '[]';

CREATE TABLE IF NOT EXISTS "{{table}}_queues" (
    queue         text        PRIMARY KEY,
    paused_at     timestamptz,
    stale_fences  bigint      NOT NULL DEFAULT 0,
    last_stale_at timestamptz,
    served_at     timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS "{{table}}_failed_idx"
    ON "{{table}}" (queue, status, id) WHERE status IN ('failed', 'dead', 'cancelled');
