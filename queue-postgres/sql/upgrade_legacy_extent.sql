-- The highest id of a legacy table: how far the backfill of the legacy upgrade has to go (its
-- progress). Reads the primary key's last entry only.
SELECT max(id)::bigint AS max_id FROM "{{table}}"
