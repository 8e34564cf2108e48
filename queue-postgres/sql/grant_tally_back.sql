-- What the grants a statement deletes give back to the queue's tally of its rate per partition
-- (grant.sql charged each whole to it: its jobs to the sum, and the least of its per_claim *
-- claims and its jobs to every slot, as untracked jobs): a subquery of one row over the CTE
-- swept (the deleted grants' final rows: grant.sql's and return_grant.sql's), rendered in
-- both. Columns: jobs, their jobs_left; slot_room, their least of per_claim * claims_left and
-- jobs_left (what their claims made, at most per_claim of any slot each and their jobs in
-- all, may have started of a slot stays charged). Only grants charged to the tally's own
-- window give anything back (a grant's window is the one its expiry falls in, expiry
-- included: grant.sql ends a grant by its window's end); one charged to a window the tally
-- has left stays in what the tally carries of it. Tokens: tally, the tally (jsonb) as the
-- statement's lock left it; per_ms, the queue's rate per partition's window (NULL without
-- one: nothing given back).
SELECT COALESCE(sum(x.jobs_left), 0)::bigint AS jobs,
       COALESCE(sum(LEAST(x.per_claim::bigint * x.claims_left, x.jobs_left)), 0)::bigint
           AS slot_room
FROM swept AS x
WHERE ({{tally}} ->> 'per_ms')::bigint = {{per_ms}}
  AND floor((x.expires_ms - 1) / {{per_ms}})::bigint = ({{tally}} ->> 'bucket')::bigint
