-- Every lease-holder write but the heartbeat, for one job or many.
--
-- Parameters, one array element per write: $1 ids; $2 generations; $10 tokens; $3 the status
-- to write;
-- $4 whether to give the claim's attempt back (a release); $5 retry instants and $6 retry delays
-- in seconds (both NULL: next_attempt_at stays); $7 errors (NULL: last_error stays); $8 whether
-- the status is terminal (stamps finished_at); $9 the outcome's name (queue_core::Finalize::kind).
-- What each outcome writes is decided in Rust (queue_postgres's encode.rs, from
-- queue_core::Finalize), never here.
--
-- An outcome with an error also appends it to the job's history (errors), with the claim's
-- attempt and generation, the time and the holder's name, keeping the last {{history_len}} and the
-- first {{history_chars}} characters of each text. A history that is not an array (edited by
-- hand) starts again from empty rather than failing the write.
--
-- Guarantees: each row is a compare-and-set on (id, status = 'in_flight', claim_generation,
-- claim_token); the rows returned are the writes that applied, the rest were refused by the
-- fence (Stale). The token ($10, last so the others keep their numbers) refuses a holder whose
-- generation a new primary handed out again after losing its claim.
UPDATE "{{table}}" AS j
SET status = u.status,
    attempts = j.attempts - CASE WHEN u.give_back THEN 1 ELSE 0 END,
    next_attempt_at = CASE
        WHEN u.run_at IS NOT NULL THEN u.run_at
        WHEN u.delay_secs IS NOT NULL THEN now() + make_interval(secs => u.delay_secs)
        ELSE j.next_attempt_at END,
    last_error = COALESCE(u.error, j.last_error),
    errors = CASE WHEN u.error IS NULL THEN j.errors ELSE jsonb_path_query_array(
        (CASE WHEN jsonb_typeof(j.errors) = 'array' THEN j.errors ELSE '[]'::jsonb END)
        || jsonb_build_array(jsonb_build_object(
            'attempt', j.attempts, 'generation', j.claim_generation, 'at', now(),
            'worker', j.claimed_by, 'outcome', u.kind, 'error', left(u.error, {{history_chars}}))),
        '$[last - {{history_last}} to last]')
    END,
    lease_expires_at = NULL,
    updated_at = now(),
    finished_at = CASE WHEN u.terminal THEN now() END
FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::bool[], $5::timestamptz[],
            $6::float8[], $7::text[], $8::bool[], $9::text[], $10::bigint[])
     AS u(id, claim_generation, status, give_back, run_at, delay_secs, error, terminal, kind,
          claim_token)
WHERE j.id = u.id AND j.status = 'in_flight' AND j.claim_generation = u.claim_generation
  AND j.claim_token = u.claim_token
RETURNING j.id, u.claim_generation, u.claim_token
