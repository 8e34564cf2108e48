-- Whether a queue's rows of "{{table}}_claim_starts" call for a fold (fold_starts.sql) before a
-- claim counts per partition: a condition on $1, the queue, rendered in place of a to_fold
-- token by claim_quota.sql and claim_rated.sql. Any row of a claim under the lock or ahead of
-- it (keyed by the claims counter: claim_key_started.sql does not read them), or 64 rows of
-- claims on grants (keyed below zero: claim_key_started.sql reads them where they are, but
-- not without bound). The claims on grants arrive without the queue's lock, so a claim that
-- folded under the lock finds a few of them again at most, and asks for no second fold.
(EXISTS (SELECT 1 FROM "{{table}}_claim_starts" AS s WHERE s.queue = $1 AND s.claim > 0)
 OR (SELECT count(*)
     FROM (SELECT 1 FROM "{{table}}_claim_starts" AS s
           WHERE s.queue = $1 AND s.claim < 0
           LIMIT 64) AS g) = 64)
