-- Enqueue one or many jobs without unique keys, atomically, in one statement: enqueue.sql's
-- path for a batch in which no job has a unique key (nothing can conflict, so no upsert, no
-- grouping by key and no lookup of a holder).
--
-- Parameters: $1 queue; $2 the table's quoted name (for its id sequence); $3 payloads (jsonb[]);
-- $4 priorities (int2[]); $5 run-at instants (timestamptz[], NULL: use $6); $6 delays in seconds
-- (float8[]); $7 wake-up channel (NULL: no NOTIFY); $8 partition keys (text[]).
--
-- Guarantees: one statement, so all rows or none. Ids are drawn from the table's sequence
-- before the insert, so every input row knows its own (its name cast to regclass once, inside
-- the subquery, not for every row). When a channel is given, one NOTIFY is
-- sent in the same transaction (delivered on commit). Rows come back in input order: the id
-- the job has, and inserted (always true here, as enqueue.sql reports it).
WITH input AS MATERIALIZED (
    SELECT u.ord,
           nextval((SELECT pg_get_serial_sequence($2, 'id')::regclass)) AS id,
           u.payload, u.priority, u.run_at, u.delay_secs, u.partition_key
    FROM unnest($3::jsonb[], $4::int2[], $5::timestamptz[], $6::float8[], $8::text[])
         WITH ORDINALITY AS u(payload, priority, run_at, delay_secs, partition_key, ord)
),
inserted AS (
    INSERT INTO "{{table}}" (id, queue, payload, priority, next_attempt_at, partition_key)
    SELECT id, $1, payload, priority,
           COALESCE(run_at, now() + make_interval(secs => COALESCE(delay_secs, 0))),
           partition_key
    FROM input
    ORDER BY ord
),
woken AS (
    SELECT pg_notify($7, $1) WHERE $7::text IS NOT NULL AND EXISTS (SELECT 1 FROM input)
)
SELECT input.id, true AS inserted
FROM input
LEFT JOIN woken ON true
ORDER BY input.ord
