-- The names of a table's indexes, and whether each is valid (the schema check: an index left
-- invalid by a CREATE INDEX CONCURRENTLY that failed serves no query).
--
-- Parameters: $1 the table's quoted name.
SELECT c.relname::text AS name, i.indisvalid AS valid
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass($1)
