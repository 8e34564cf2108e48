-- Whether a table's id draws from a sequence (serial or identity), which enqueue.sql needs.
--
-- Parameters: $1 the table's quoted name. NULL when the table does not exist.
SELECT pg_get_serial_sequence($1, 'id') IS NOT NULL AS has_sequence
WHERE to_regclass($1) IS NOT NULL
