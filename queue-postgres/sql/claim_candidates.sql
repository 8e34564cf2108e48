-- The candidates of a limited claim's picks (claim_picks.sql renders this in place of its
-- candidates token, for claim_limited.sql and claim_turns.sql): the due jobs and the takeovers
-- of expired leases, each partition's earliest in claim order within the starts its rate per
-- partition leaves (quota.key_rate_starts less its claims within the window): a takeover is a
-- start too. Without a rate per partition, all of them. Parameters as claim.sql's.
(SELECT u.id, u.next_attempt_at, u.priority, u.reclaims, u.expired, u.partition_key
 FROM (SELECT c.*, row_number() OVER (PARTITION BY c.partition_key
                                      ORDER BY c.next_attempt_at, c.priority, c.id) AS nth
       FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c) AS u
 WHERE u.partition_key IS NULL OR (SELECT key_rate_starts FROM quota) IS NULL
    OR u.nth <= (SELECT key_rate_starts FROM quota) - {{key_started}}) AS candidates
