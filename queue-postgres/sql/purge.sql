-- One batch of an operator's purge: terminal jobs of a queue in the given statuses, finished
-- longer ago than the age, oldest first, through "{{table}}_finished_idx".
--
-- Parameters: $1 queue; $2 statuses (text[]); $3 the age in seconds; $4 the batch size.
-- SKIP LOCKED: a row another transaction holds is left for the next batch. Returns how many
-- rows it deleted.
WITH doomed AS (
    SELECT id FROM "{{table}}"
    WHERE finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => $3)
      AND queue = $1 AND status = ANY($2::text[])
    ORDER BY finished_at
    LIMIT $4
    FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM "{{table}}" AS j USING doomed WHERE j.id = doomed.id RETURNING 1
)
SELECT count(*) AS deleted FROM deleted
