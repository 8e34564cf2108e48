-- The room of the partition a walk of claim_turns.sql found (f: its key and earliest job; q:
-- the walk's limits), rendered in place of its walk_room token: none when its earliest job is
-- not due, else the least of what max_per_partition leaves of its jobs in flight (the quota's
-- held object) and what its rate per partition leaves of its claims within the window
-- (claim_key_started.sql), at most the claim's new jobs (queue_core::QueueLimits::partition_room).
SELECT CASE WHEN f.next_attempt_at <= now()
       THEN GREATEST(0, LEAST(
                q.new_jobs,
                q.per_partition - COALESCE(((SELECT counts FROM held) ->> f.partition_key)::bigint, 0),
                q.key_rate_starts - {{key_started}}))
       ELSE 0 END AS room