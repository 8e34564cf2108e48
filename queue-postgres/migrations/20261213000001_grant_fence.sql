-- The fence of room grants (docs/adr/0004-room-grants.md): while a queue's switch room_grants
-- is on, a write of its row that moves its claims counter must come from a release that
-- counts grants. Every claim, grant and change of limits or of the switch of such a release
-- flips grants_counted in the same write; a write that moves claims without flipping it (a
-- claim of an older release, which would claim past the room granted, or an older tool's
-- change of the limits) fails while the switch is on, with SQLSTATE QG001, and nothing it
-- wrote stays. The switch, not the grants' rows: an older claim counts the jobs in flight from
-- its snapshot, and a grant whose claims committed after that snapshot may be deleted before
-- the older claim writes the row (a return or a sweep moves no counter), so no grant would be
-- left to see. A switch turned on moves claims, so an older claim that began before it is
-- stale by its own check. Turning the switch off passes (it deletes the grants).
--
-- So that every claim whose snapshot predates a change of the switch is stale, a write that
-- changes it without moving claims (by hand) moves claims too (the trigger
-- {{table}}_grants_switch, which fires after the fence: triggers fire by name). Otherwise a
-- claim whose snapshot holds a grant's room, spent since by claims it does not see, would read
-- the switch off on the newest row and count no grant.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS grants_counted boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION "{{table}}_grants_fence"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = 'QG001',
        MESSAGE = format('queue %s has room grants on, and this write of its claims counter '
                         'comes from a release that does not count them', NEW.queue),
        HINT = 'Run a release that counts room grants on every worker and tool of the queue, '
               'or switch room grants off.';
END
$$;

DROP TRIGGER IF EXISTS "{{table}}_grants_fence" ON "{{table}}_queues";

CREATE TRIGGER "{{table}}_grants_fence"
    BEFORE UPDATE ON "{{table}}_queues"
    FOR EACH ROW
    WHEN (NEW.room_grants
          AND NEW.claims IS DISTINCT FROM OLD.claims
          AND NEW.grants_counted IS NOT DISTINCT FROM OLD.grants_counted)
    EXECUTE FUNCTION "{{table}}_grants_fence"();

CREATE OR REPLACE FUNCTION "{{table}}_grants_switch"() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.claims := OLD.claims + 1;
    RETURN NEW;
END
$$;

DROP TRIGGER IF EXISTS "{{table}}_grants_switch" ON "{{table}}_queues";

CREATE TRIGGER "{{table}}_grants_switch"
    BEFORE UPDATE ON "{{table}}_queues"
    FOR EACH ROW
    WHEN (NEW.room_grants IS DISTINCT FROM OLD.room_grants
          AND NEW.claims IS NOT DISTINCT FROM OLD.claims)
    EXECUTE FUNCTION "{{table}}_grants_switch"();
