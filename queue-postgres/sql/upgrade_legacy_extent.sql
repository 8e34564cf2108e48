-- The ids of a legacy table: where the backfill of the legacy upgrade starts (below the lowest)
-- and ends (the highest when it began), and so its progress. Reads the two ends of the primary
-- key only.
SELECT min(id)::bigint AS min_id, max(id)::bigint AS max_id FROM "{{table}}"
