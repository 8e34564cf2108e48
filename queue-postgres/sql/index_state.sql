-- Whether an index exists, on which table, and whether it is valid (a CREATE INDEX CONCURRENTLY
-- that failed leaves an invalid one): the legacy upgrade's runner, before it builds an index.
--
-- Parameters: $1 the index's quoted name; $2 the table's quoted name. No row: there is no such
-- index.
SELECT i.indisvalid AS valid, i.indrelid = to_regclass($2) AS on_table
FROM pg_index i
WHERE i.indexrelid = to_regclass($1)
