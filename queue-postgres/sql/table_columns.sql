-- The columns of a table and their types, as format_type spells them (the schema check).
--
-- Parameters: $1 the table's quoted name, resolved on the search path.
SELECT a.attname::text AS name, format_type(a.atttypid, a.atttypmod) AS type
FROM pg_attribute a
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
