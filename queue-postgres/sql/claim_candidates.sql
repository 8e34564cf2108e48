-- The candidates of a limited claim's picks (claim_picks.sql renders this in place of its
-- candidates token, for claim_limited.sql and claim_turns.sql): the due jobs and the takeovers
-- of expired leases, each partition's earliest in claim order within the starts its rate per
-- partition leaves (rated.key_rate_starts less its claims within the window, read once per
-- partition): a takeover is a start too. Only partitions with a takeover are read: the due
-- jobs alone are within their partitions' starts already (claim_limited.sql's pick is taken
-- only when it is; claim_turns.sql offers each partition up to its room). Without a rate per
-- partition, all of them, neither numbered nor read (nor while the queue's tally, or its tally
-- per slot, leaves room for the claim: rated.key_rate_starts is NULL then, claim_rated.sql).
-- Parameters as claim.sql's.
(SELECT * FROM due WHERE (SELECT key_rate_starts FROM rated) IS NULL
 UNION ALL
 SELECT * FROM expired WHERE (SELECT key_rate_starts FROM rated) IS NULL
 UNION ALL
 SELECT u.id, u.next_attempt_at, u.priority, u.reclaims, u.expired, u.partition_key
 FROM (SELECT c.*, row_number() OVER (PARTITION BY c.partition_key
                                      ORDER BY c.next_attempt_at, c.priority, c.id) AS nth
       FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c) AS u
 LEFT JOIN (SELECT k.key, (SELECT key_rate_starts FROM rated) - {{key_started}} AS starts_left
            FROM (SELECT DISTINCT partition_key AS key
                  FROM expired AS p
                  WHERE p.partition_key IS NOT NULL
                    AND (SELECT key_rate_starts FROM rated) IS NOT NULL) AS k) AS l
        ON l.key = u.partition_key
 WHERE (SELECT key_rate_starts FROM rated) IS NOT NULL
   AND (l.key IS NULL OR u.nth <= l.starts_left)) AS candidates