-- How many of one partition's jobs (the key: {{key}}) the queue's claims took within its rate
-- per partition's window, by the time the claim took the queue's lock (quota.now_ms): the sum
-- of its rate_log's entries in "{{table}}_starts", one read by primary key; 0
-- without a rate per partition (the read is skipped). Rendered in place of a key_started
-- token by claim_candidates.sql, claim_limited.sql and claim_turns.sql, after claim_quota.sql
-- and the CTE rated (claim_rated.sql or claim_rated_before_pick.sql).
(SELECT COALESCE(sum((e ->> 1)::bigint), 0)
 FROM "{{table}}_starts" AS s
 CROSS JOIN LATERAL jsonb_array_elements(s.rate_log) AS e
 WHERE (SELECT key_rate_per_ms FROM rated) IS NOT NULL
   AND s.queue = $1 AND s.partition_key = {{key}}
   AND (e ->> 0)::float8 > (SELECT q.now_ms - r.key_rate_per_ms FROM quota AS q, rated AS r))