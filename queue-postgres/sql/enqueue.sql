-- Enqueue one or many jobs in one statement.
--
-- Parameters: $1 queue; $2 the table's quoted name (for its id sequence); $3 payloads (jsonb[]);
-- $4 priorities (int2[]); $5 run-at instants (timestamptz[], NULL: use $6); $6 delays in seconds
-- (float8[]); $7 unique keys (text[]); $8 wake-up channel (NULL: no NOTIFY).
--
-- Guarantees: ids are drawn from the table's sequence before the insert, so every input row
-- knows its id whatever order RETURNING would use; a unique-key conflict inserts nothing and
-- reports the row as not inserted (its holder is found by lookup_unique.sql). When a channel is
-- given, one NOTIFY is sent in the same transaction (delivered on commit) if anything was
-- inserted. Rows come back in input order.
WITH input AS MATERIALIZED (
    SELECT u.ord,
           nextval((SELECT pg_get_serial_sequence($2, 'id'))::regclass) AS id,
           u.payload, u.priority, u.run_at, u.delay_secs, u.unique_key
    FROM unnest($3::jsonb[], $4::int2[], $5::timestamptz[], $6::float8[], $7::text[])
         WITH ORDINALITY AS u(payload, priority, run_at, delay_secs, unique_key, ord)
),
inserted AS (
    INSERT INTO "{{table}}" (id, queue, payload, priority, next_attempt_at, unique_key)
    SELECT id, $1, payload, priority,
           COALESCE(run_at, now() + make_interval(secs => COALESCE(delay_secs, 0))),
           unique_key
    FROM input
    ORDER BY ord
    ON CONFLICT (queue, unique_key) WHERE unique_key IS NOT NULL DO NOTHING
    RETURNING id
),
woken AS (
    SELECT pg_notify($8, $1)
    FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted
    WHERE $8::text IS NOT NULL
)
SELECT input.id, inserted.id IS NOT NULL AS inserted, input.unique_key
FROM input
LEFT JOIN inserted ON inserted.id = input.id
LEFT JOIN woken ON true
ORDER BY input.ord
