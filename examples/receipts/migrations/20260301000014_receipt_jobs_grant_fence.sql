-- The fence of room grants (docs/adr/0004-room-grants.md): while a queue holds grants, a write
-- of its row that moves its claims counter must come from a release that counts them. Every
-- claim, grant and change of limits of such a release flips grants_counted in the same write;
-- a write that moves claims without flipping it (a claim of an older release, which would
-- claim past the room granted, or an older tool's change of the limits) fails while the queue
-- has a grant's row, with SQLSTATE QG001, and nothing it wrote stays. Without grants it goes
-- through: nothing is then granted for it to pass. The trigger runs once the row is locked,
-- and its query reads the grants as committed then: a grant commits with its write of the row
-- (it moves claims), so a write that waited for it sees it.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS grants_counted boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION "receipt_jobs_grants_fence"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM "receipt_jobs_grants" WHERE queue = NEW.queue) THEN
        RAISE EXCEPTION USING
            ERRCODE = 'QG001',
            MESSAGE = format('queue %s holds room grants, and this write of its claims counter '
                             'comes from a release that does not count them', NEW.queue),
            HINT = 'Run a release that counts room grants on every worker and tool of the '
                   'queue, or switch room grants off with one.';
    END IF;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS "receipt_jobs_grants_fence" ON "receipt_jobs_queues";

CREATE TRIGGER "receipt_jobs_grants_fence"
    BEFORE UPDATE ON "receipt_jobs_queues"
    FOR EACH ROW
    WHEN (NEW.claims IS DISTINCT FROM OLD.claims
          AND NEW.grants_counted IS NOT DISTINCT FROM OLD.grants_counted)
    EXECUTE FUNCTION "receipt_jobs_grants_fence"();
