-- The jobs holding unique keys, after an enqueue found them taken.
--
-- Parameters: $1 queue; $2 keys (text[]).
-- Returns (unique_key, id) per key still held.
SELECT unique_key, id FROM "{{table}}" WHERE queue = $1 AND unique_key = ANY($2::text[])
