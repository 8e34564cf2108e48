-- How many of one partition's jobs (the key: {{key}}) the queue's claims took within its rate
-- per partition's window, by the time the claim took the queue's lock (quota.now_ms), and how
-- many more the room granted to queue handles may still start: the sum of its rate_log's
-- entries in "{{table}}_starts", one read by primary key; plus the claims on grants
-- (claim_granted.sql: rows of "{{table}}_claim_starts" keyed below zero, not yet folded), read
-- once for all partitions into a jsonb object; plus every grant's least of per_claim *
-- claims_left (its cap a slot, which caps each partition of it) and jobs_left (a claim on a
-- grant that commits after this statement's snapshot moves its jobs from those, which the
-- snapshot counts). 0 without a rate per partition (the reads are skipped). Rendered in place
-- of a key_started token by claim_candidates.sql, claim_limited.sql and claim_turns.sql, after
-- claim_quota.sql and the CTE rated (claim_rated.sql or claim_rated_before_pick.sql).
((SELECT COALESCE(sum((e ->> 1)::bigint), 0)
  FROM "{{table}}_starts" AS s
  CROSS JOIN LATERAL jsonb_array_elements(s.rate_log) AS e
  WHERE (SELECT key_rate_per_ms FROM rated) IS NOT NULL
    AND s.queue = $1 AND s.partition_key = {{key}}
    AND (e ->> 0)::float8 > (SELECT q.now_ms - r.key_rate_per_ms FROM quota AS q, rated AS r))
 + COALESCE(((SELECT jsonb_object_agg(x.key, x.jobs)
              FROM (SELECT u.key, sum(u.jobs) AS jobs
                    FROM "{{table}}_claim_starts" AS s
                    CROSS JOIN LATERAL unnest(s.keys, s.jobs) AS u (key, jobs)
                    WHERE (SELECT key_rate_per_ms FROM rated) IS NOT NULL
                      AND s.queue = $1 AND s.claim < 0
                      AND s.at_ms > (SELECT q.now_ms - r.key_rate_per_ms
                                     FROM quota AS q, rated AS r)
                    GROUP BY u.key) AS x) ->> {{key}})::bigint, 0)
 + (SELECT COALESCE(sum(LEAST(g.per_claim::bigint * g.claims_left, g.jobs_left)), 0)::bigint
    FROM "{{table}}_grants" AS g
    WHERE (SELECT key_rate_per_ms FROM rated) IS NOT NULL AND g.queue = $1))
