-- Ids for a bulk enqueue by COPY (enqueue_copy.sql), drawn from the table's sequence, and the
-- transaction's clock, which a due time counts from (the now() an INSERT of this transaction
-- would see).
--
-- Parameters: $1 the table's quoted name; $2 how many ids.
--
-- One row: the ids as an array (a row each cost the server and the client a message per id) and
-- the clock. The sequence's name is cast to regclass inside the subquery, which runs once: cast
-- outside it, the cast (a catalog lookup) ran for every id.
SELECT coalesce(array_agg(nextval((SELECT pg_get_serial_sequence($1, 'id')::regclass))), '{}')
           AS ids,
       now() AS now
FROM generate_series(1, $2::bigint)
