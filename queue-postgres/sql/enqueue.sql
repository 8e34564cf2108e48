-- Enqueue one or many jobs, atomically, in one statement.
--
-- Parameters: $1 queue; $2 the table's quoted name (for its id sequence); $3 payloads (jsonb[]);
-- $4 priorities (int2[]); $5 run-at instants (timestamptz[], NULL: use $6); $6 delays in seconds
-- (float8[]); $7 unique keys (text[]); $8 wake-up channel (NULL: no NOTIFY); the unique scope of
-- each job (queue_core::UniqueScope): $9 the statuses a holder keeps the key in, each a text
-- array literal such as '{in_flight,pending}' (text[], NULL: every status), $10 how many seconds
-- after its enqueue a holder keeps it (float8[], NULL: for ever), $11 whether a duplicate
-- replaces a pending holder's payload, priority and due time (bool[]); $12 partition keys
-- (text[]; a replacing duplicate keeps its holder's).
--
-- Guarantees: one statement, so all rows or none. Ids are drawn from the table's sequence
-- before the insert, so every input row knows its own (its name cast to regclass once, inside
-- the subquery, not for every row). A holder out of the new job's scope gives
-- its key up first (released: its row stays, without the key), and a pending holder in scope
-- takes a replacing job's values (replaced); neither runs for a job of the default scope. A
-- unique key still held (committed before, or by a transaction this one waited for) inserts
-- nothing: the upsert's no-op update returns the holder's id, whatever this statement's snapshot
-- sees, so the result is exact; a key repeated within the call is inserted once and the later
-- rows report the first's id (the caller refuses a repeated key when one of its jobs has a
-- scope). The scalar subqueries over released and replaced run them to completion before the
-- first row is inserted, and a row this statement updated is never updated again by it. When a
-- channel is given, one NOTIFY is sent in the same transaction (delivered on commit) if anything
-- was inserted or replaced. Rows come back in input order: the id the job has, whether this call
-- inserted it, and whether it replaced its holder's values.
WITH input AS MATERIALIZED (
    SELECT u.ord,
           nextval((SELECT pg_get_serial_sequence($2, 'id')::regclass)) AS id,
           u.payload, u.priority, u.run_at, u.delay_secs, u.unique_key,
           u.held_while::text[] AS held_while, u.held_for_secs, u.replaces, u.partition_key,
           u.unique_key IS NULL
               OR row_number() OVER (PARTITION BY u.unique_key ORDER BY u.ord) = 1 AS first_of_key
    FROM unnest($3::jsonb[], $4::int2[], $5::timestamptz[], $6::float8[], $7::text[],
                $9::text[], $10::float8[], $11::bool[], $12::text[])
         WITH ORDINALITY AS u(payload, priority, run_at, delay_secs, unique_key,
                              held_while, held_for_secs, replaces, partition_key, ord)
),
released AS (
    UPDATE "{{table}}" AS held
    SET unique_key = NULL
    FROM (SELECT * FROM input
          WHERE unique_key IS NOT NULL AND first_of_key
            AND (held_while IS NOT NULL OR held_for_secs IS NOT NULL)) AS scoped
    WHERE held.queue = $1 AND held.unique_key = scoped.unique_key
      AND ((scoped.held_while IS NOT NULL AND held.status <> ALL (scoped.held_while))
           OR (scoped.held_for_secs IS NOT NULL
               AND held.created_at <= now() - make_interval(secs => scoped.held_for_secs)))
    RETURNING held.id
),
replaced AS (
    UPDATE "{{table}}" AS held
    SET payload = replacing.payload,
        priority = replacing.priority,
        next_attempt_at = COALESCE(replacing.run_at,
                                   now() + make_interval(secs => COALESCE(replacing.delay_secs, 0))),
        updated_at = now()
    FROM (SELECT * FROM input WHERE replaces AND unique_key IS NOT NULL) AS replacing
    WHERE held.queue = $1 AND held.unique_key = replacing.unique_key
      AND held.status = 'pending'
      AND held.id NOT IN (SELECT id FROM released)
    RETURNING held.id, held.unique_key
),
upserted AS (
    INSERT INTO "{{table}}" (id, queue, payload, priority, next_attempt_at, unique_key,
                             partition_key)
    SELECT id, $1, payload, priority,
           COALESCE(run_at, now() + make_interval(secs => COALESCE(delay_secs, 0))),
           unique_key, partition_key
    FROM input
    WHERE first_of_key
      AND (SELECT count(*) FROM released) >= 0
      AND (unique_key IS NULL
           OR NOT unique_key = ANY (COALESCE((SELECT array_agg(unique_key) FROM replaced), '{}')))
    ORDER BY ord
    ON CONFLICT (queue, unique_key) WHERE unique_key IS NOT NULL
        DO UPDATE SET unique_key = EXCLUDED.unique_key
    RETURNING id, unique_key
),
woken AS (
    SELECT pg_notify($8, $1)
    FROM (SELECT 1 FROM input JOIN upserted USING (id)
          UNION ALL SELECT 1 FROM replaced
          LIMIT 1) AS any_new
    WHERE $8::text IS NOT NULL
)
SELECT COALESCE(by_id.id, by_key.id, rep.id) AS id,
       by_id.id IS NOT NULL AS inserted,
       rep.id IS NOT NULL AND input.replaces AS replaced
FROM input
LEFT JOIN upserted AS by_id ON by_id.id = input.id
LEFT JOIN upserted AS by_key ON by_key.unique_key = input.unique_key
LEFT JOIN replaced AS rep ON rep.unique_key = input.unique_key
LEFT JOIN woken ON true
ORDER BY input.ord
