-- Whether an index exists and is valid (a CREATE INDEX CONCURRENTLY that failed leaves an
-- invalid one): the legacy upgrade's runner, before it builds an index.
--
-- Parameters: $1 the index's quoted name. No row: there is no such index.
SELECT i.indisvalid AS valid
FROM pg_index i
WHERE i.indexrelid = to_regclass($1)
