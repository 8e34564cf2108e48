-- Ids for a bulk enqueue by COPY (enqueue_copy.sql), drawn from the table's sequence, and the
-- transaction's clock, which a due time counts from (the now() an INSERT of this transaction
-- would see).
--
-- Parameters: $1 the table's quoted name; $2 how many ids.
SELECT nextval((SELECT pg_get_serial_sequence($1, 'id'))::regclass) AS id, now() AS now
FROM generate_series(1, $2::bigint)
