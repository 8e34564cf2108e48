-- The legacy upgrade, phase 2 of 4: terminal rows of the legacy table carry no finished_at;
-- stamp them with the upgrade's time so that the retention sweep reaches them (their retention
-- counts from the upgrade). One bounded batch of the primary key per statement, each its own
-- transaction: row locks on at most {{limit}} rows for milliseconds, never the table.
--
-- Parameters: {{after}} the last id of the previous batch (below the lowest id to start), {{limit}} the batch size,
-- {{until}} the highest id when the backfill began (rows inserted later are the release's own:
-- the backfill does not chase a live writer). The runner binds $1, $2 and $3; the migration form
-- is a DO block whose variables they are.
-- Returns last_id, the highest id of this batch (NULL: no row is left), and stamped, how many
-- rows it stamped. Idempotent: a batch run again stamps nothing, so an interrupted backfill is
-- resumed by running it again (from the start, or from the last id it reported). The runner
-- gives each batch a lock_timeout and tries it again when a legacy transaction holds one of its
-- rows, so that the batch never keeps its own row locks while it waits.
WITH batch AS (
    SELECT id FROM "{{table}}" WHERE id > {{after}}::bigint AND id <= {{until}}::bigint ORDER BY id LIMIT {{limit}}
), stamped AS (
    UPDATE "{{table}}" AS t SET finished_at = now()
    FROM batch
    WHERE t.id = batch.id
      AND t.finished_at IS NULL
      AND t.status IN ('completed', 'failed', 'dead', 'cancelled')
    RETURNING 1
)
SELECT (SELECT max(id) FROM batch)::bigint AS last_id, (SELECT count(*) FROM stamped) AS stamped
