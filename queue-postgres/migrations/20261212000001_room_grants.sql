-- Room granted to a queue handle for several claims (docs/adr/0004-room-grants.md). The
-- switch room_grants, per queue, is the operator's: off by default, and on only once every
-- worker of the queue runs a release that counts grants (an older one would claim past them).
-- A grant is one handle's room: jobs_left more jobs it may put in flight, claims_left more
-- claims, at most per_claim jobs of one partition a claim, until expires_at (the database's
-- clock). A grant counts against the limits until its row is deleted, expired or not: room
-- comes back only by the delete. grant_id is never reused. A change of a queue's limits or of
-- its switch, or the queue's row deleted, deletes its grants (the trigger), whichever tool or
-- release writes the row: room granted under the old limits is never spent under new ones.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS room_grants boolean NOT NULL DEFAULT false;

CREATE TABLE IF NOT EXISTS "{{table}}_grants" (
    queue       text        NOT NULL,
    grant_id    bigint      GENERATED ALWAYS AS IDENTITY,
    holder      text,
    jobs_left   bigint      NOT NULL CHECK (jobs_left >= 0),
    claims_left integer     NOT NULL CHECK (claims_left >= 0),
    per_claim   integer     NOT NULL CHECK (per_claim >= 1),
    expires_at  timestamptz NOT NULL,
    granted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue, grant_id)
);

CREATE OR REPLACE FUNCTION "{{table}}_grants_reset"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM "{{table}}_grants" WHERE queue = OLD.queue;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS "{{table}}_grants_reset" ON "{{table}}_queues";

CREATE TRIGGER "{{table}}_grants_reset"
    AFTER UPDATE ON "{{table}}_queues"
    FOR EACH ROW
    WHEN ((OLD.max_in_flight, OLD.rate_starts, OLD.rate_per_ms, OLD.max_per_partition,
           OLD.partition_rate_starts, OLD.partition_rate_per_ms, OLD.room_grants)
          IS DISTINCT FROM
          (NEW.max_in_flight, NEW.rate_starts, NEW.rate_per_ms, NEW.max_per_partition,
           NEW.partition_rate_starts, NEW.partition_rate_per_ms, NEW.room_grants))
    EXECUTE FUNCTION "{{table}}_grants_reset"();

DROP TRIGGER IF EXISTS "{{table}}_grants_gone" ON "{{table}}_queues";

CREATE TRIGGER "{{table}}_grants_gone"
    AFTER DELETE ON "{{table}}_queues"
    FOR EACH ROW
    EXECUTE FUNCTION "{{table}}_grants_reset"();
