-- The rate's log of a queue that grants room, as a statement that deletes grants writes it
-- (grant.sql and return_grant.sql render this in place of their rewritten_log token, after a
-- CTE swept: the grants the statement deleted, as sql.rs's SWEPT_RETURNING returns them).
-- The entries within the window ending at the statement's instant, each deleted grant's entry
-- ([expiry, jobs, grant_id]) made [the least of its expiry and the delete, the jobs its claims
-- took]: a deleted grant's jobs_left, read as the delete returned its row, is final (the
-- delete waited for any claim on it that held the row), no claim on it can start a job after
-- the delete, and none started one after its expiry. Tokens: log, the log (jsonb); per_ms,
-- the window's length; now_ms, the instant it ends at (epoch milliseconds).
COALESCE((
    SELECT jsonb_agg(CASE WHEN x.grant_id IS NULL THEN e
                          ELSE jsonb_build_array(LEAST((e ->> 0)::float8, x.at_ms),
                                                 (e ->> 1)::bigint - x.jobs_left)
                     END)
    FROM jsonb_array_elements({{log}}) AS e
    LEFT JOIN swept AS x ON x.grant_id = (e ->> 2)::bigint
    WHERE (e ->> 0)::float8 > {{now_ms}} - {{per_ms}}), '[]')
