-- The names of a table's indexes (the schema check).
--
-- Parameters: $1 the table's quoted name.
SELECT c.relname::text AS name
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass($1)
