-- Records what a scheduler runs on a queue (queue_core::Admin::record_schedules): one row per
-- schedule, stamped with the database's clock; the latest period handled never goes back (a
-- scheduler that lags reports an older one).
--
-- Parameters: $1 queue; $2 the scheduler's name; $3 names (text[]); $4 specs (text[]); $5 the
-- missed-period policies (text[]); $6 the latest periods handled (timestamptz[]); $7 the next
-- periods (timestamptz[]). One element per schedule.
INSERT INTO "{{table}}_schedules" AS s (queue, name, spec, missed, through, next_at, seen_at, seen_by)
SELECT $1, r.name, r.spec, r.missed, r.through, r.next_at, now(), $2
FROM unnest($3::text[], $4::text[], $5::text[], $6::timestamptz[], $7::timestamptz[])
     AS r(name, spec, missed, through, next_at)
ON CONFLICT (queue, name) DO UPDATE
SET spec = EXCLUDED.spec,
    missed = EXCLUDED.missed,
    through = GREATEST(s.through, EXCLUDED.through),
    next_at = EXCLUDED.next_at,
    seen_at = EXCLUDED.seen_at,
    seen_by = EXCLUDED.seen_by
