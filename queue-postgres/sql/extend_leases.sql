-- Heartbeats of many claims in one statement: each job asked whose row no other transaction
-- holds is held for the lease ($3 seconds) more from the database's now(), and claimed_at is
-- restamped, fenced like a finalize (extend_lease.sql says what one heartbeat guarantees).
--
-- Parameters, one array element per claim: $1 ids; $2 generations; $4 tokens; and $3 the lease
-- in seconds. One row back per claim asked (id, claim_generation, claim_token) with its answer:
-- 'held'; 'cancel_requested' (held, and an operator asked to cancel the job); 'lost' (the
-- fence refused: another claim holds the job, or it left in_flight or the table); 'busy':
-- another transaction holds the row's lock (a finalize with hooks, an operator's cancel, a
-- replacing enqueue), and the statement did not wait for it (SKIP LOCKED), so that one locked
-- row holds up no other renewal: ask again for that job alone (extend_lease.sql, which waits).
--
-- The rows are named by id alone (the primary key is then the only path whatever the
-- statistics say, as claim_picks.sql's write), the status compared with (SELECT 'in_flight')
-- as in extend_lease.sql, and the fence read from the claims asked as one hashed set.
WITH asked AS MATERIALIZED (
    SELECT *
    FROM unnest($1::bigint[], $2::bigint[], $4::bigint[]) AS u (id, claim_generation, claim_token)
),
free AS MATERIALIZED (
    SELECT j.id
    FROM "{{table}}" AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM asked))
    FOR UPDATE SKIP LOCKED
),
present AS MATERIALIZED (
    -- Read only when a row was not free (a CTE runs when first read): whether it is there.
    SELECT j.id
    FROM "{{table}}" AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM asked))
),
renewed AS (
    UPDATE "{{table}}" AS j
    SET claimed_at = now(), lease_expires_at = now() + make_interval(secs => $3),
        lease_generation = j.claim_generation, updated_at = now()
    WHERE j.id = ANY (ARRAY(SELECT id FROM free))
      AND j.status = (SELECT 'in_flight')
      AND (j.id, j.claim_generation, j.claim_token) IN (SELECT * FROM asked)
    RETURNING j.id, j.claim_generation, j.claim_token,
              j.cancel_requested_at IS NOT NULL AS cancel_requested
)
SELECT a.id, a.claim_generation, a.claim_token,
       CASE WHEN r.id IS NOT NULL AND r.cancel_requested THEN 'cancel_requested'
            WHEN r.id IS NOT NULL THEN 'held'
            WHEN a.id IN (SELECT id FROM free) THEN 'lost'
            WHEN a.id IN (SELECT id FROM present) THEN 'busy'
            ELSE 'lost' END AS answer
FROM asked AS a
LEFT JOIN renewed AS r
       ON r.id = a.id AND r.claim_generation = a.claim_generation
      AND r.claim_token = a.claim_token
