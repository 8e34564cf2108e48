-- Locks a queue's controls row for the rest of the transaction: how claims of a queue with
-- limits take turns (claim_limited.sql runs next, in the same transaction, with a snapshot
-- taken after the lock, so it sees every claim that held the lock before it).
--
-- Parameters: $1 queue. Returns the row's limits (no row: no limits, nothing locked).
SELECT max_in_flight, rate_starts, rate_per_ms
FROM "{{table}}_queues"
WHERE queue = $1
FOR UPDATE
