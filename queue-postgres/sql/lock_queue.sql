-- Locks a queue's controls row for the rest of the transaction, before claim_limited.sql in
-- the same transaction: that statement's snapshot is then younger than the lock and sees every
-- claim that held it before (the path a claim takes when, alone, it found its snapshot stale).
--
-- Parameters: $1 queue. Returns the row's limits and its switch of room grants (no row: no
-- limits, nothing locked).
SELECT max_in_flight, rate_starts, rate_per_ms, max_per_partition, partition_rate_starts,
       partition_rate_per_ms, room_grants
FROM "{{table}}_queues"
WHERE queue = $1
FOR UPDATE
