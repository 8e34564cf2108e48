-- Enqueue one or many jobs, atomically, in one statement.
--
-- Parameters: $1 queue; $2 the table's quoted name (for its id sequence); $3 payloads (jsonb[]);
-- $4 priorities (int2[]); $5 run-at instants (timestamptz[], NULL: use $6); $6 delays in seconds
-- (float8[]); $7 unique keys (text[]); $8 wake-up channel (NULL: no NOTIFY).
--
-- Guarantees: one statement, so all rows or none. Ids are drawn from the table's sequence
-- before the insert, so every input row knows its own. A unique key already held (committed
-- before, or by a transaction this one waited for) inserts nothing: the upsert's no-op update
-- returns the holder's id, whatever this statement's snapshot sees, so the result is exact; a
-- key repeated within the call is inserted once and the later rows report the first's id. When
-- a channel is given, one NOTIFY is sent in the same transaction (delivered on commit) if
-- anything was inserted. Rows come back in input order: the id the job has, and whether this
-- call inserted it.
WITH input AS MATERIALIZED (
    SELECT u.ord,
           nextval((SELECT pg_get_serial_sequence($2, 'id'))::regclass) AS id,
           u.payload, u.priority, u.run_at, u.delay_secs, u.unique_key,
           u.unique_key IS NULL
               OR row_number() OVER (PARTITION BY u.unique_key ORDER BY u.ord) = 1 AS first_of_key
    FROM unnest($3::jsonb[], $4::int2[], $5::timestamptz[], $6::float8[], $7::text[])
         WITH ORDINALITY AS u(payload, priority, run_at, delay_secs, unique_key, ord)
),
upserted AS (
    INSERT INTO "{{table}}" (id, queue, payload, priority, next_attempt_at, unique_key)
    SELECT id, $1, payload, priority,
           COALESCE(run_at, now() + make_interval(secs => COALESCE(delay_secs, 0))),
           unique_key
    FROM input
    WHERE first_of_key
    ORDER BY ord
    ON CONFLICT (queue, unique_key) WHERE unique_key IS NOT NULL
        DO UPDATE SET unique_key = EXCLUDED.unique_key
    RETURNING id, unique_key
),
woken AS (
    SELECT pg_notify($8, $1)
    FROM (SELECT 1 FROM input JOIN upserted USING (id) LIMIT 1) AS any_inserted
    WHERE $8::text IS NOT NULL
)
SELECT COALESCE(by_id.id, by_key.id) AS id, by_id.id IS NOT NULL AS inserted
FROM input
LEFT JOIN upserted AS by_id ON by_id.id = input.id
LEFT JOIN upserted AS by_key ON by_key.unique_key = input.unique_key
LEFT JOIN woken ON true
ORDER BY input.ord
