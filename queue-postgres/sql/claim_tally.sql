-- What a queue's tally of its rate per partition (partition_tally, partition_slots: table
-- migrations 20261208000001 and 20261209000001) says at one instant, for a claim of some jobs:
-- a subquery of one row (claim_quota.sql renders it for the row it locked, at the instant
-- after the lock, for the batch asked; claim_ahead.sql for its snapshot's row, and for the
-- newest row at the instant of its write, for the jobs it took). Tokens: row, the alias of
-- the "{{table}}_queues" row; now_ms, the instant in epoch milliseconds; jobs, the claim's
-- jobs. claim_quota.sql says how the tally and its slots bound a partition's starts.
--
-- Columns: per_ms, the rate per partition's window (NULL without one); ahead, how many windows
-- the instant is past the tally's; whole, whether the tally counted every claim of the sliding
-- window (its window length, since a whole window); unbound, whether the tally's sum leaves
-- room for the jobs (then no partition can go over its rate); kept, whether the slots count
-- the tally's window; untracked, the tally's jobs the slots did not count (charged to every
-- slot); usable, whether the slots bound every partition's starts within the sliding window:
-- slot_base plus the partition's slot's count in slot_counts (element slot + 1).
SELECT k.per_ms, a.ahead, a.whole,
       COALESCE(
           a.whole
           AND a.ahead >= 0
           AND CASE a.ahead
                   WHEN 0 THEN ({{row}}.partition_tally ->> 'jobs')::bigint
                               + ({{row}}.partition_tally ->> 'before')::bigint
                   WHEN 1 THEN ({{row}}.partition_tally ->> 'jobs')::bigint
                   ELSE 0 END + {{jobs}} <= {{row}}.partition_rate_starts,
           false) AS unbound,
       v.kept,
       v.untracked,
       COALESCE(a.whole AND a.ahead >= 0 AND v.kept, false) AS usable,
       CASE a.ahead WHEN 0 THEN ({{row}}.partition_tally ->> 'slot_before')::bigint + v.untracked
                    WHEN 1 THEN v.untracked
                    ELSE 0 END AS slot_base,
       CASE WHEN a.ahead <= 1 THEN {{row}}.partition_slots END AS slot_counts
FROM (SELECT CASE WHEN {{row}}.partition_rate_starts IS NOT NULL
                  THEN {{row}}.partition_rate_per_ms END AS per_ms) AS k
CROSS JOIN LATERAL (
    SELECT floor({{now_ms}} / k.per_ms)::bigint
           - ({{row}}.partition_tally ->> 'bucket')::bigint AS ahead,
           k.per_ms IS NOT NULL
           AND ({{row}}.partition_tally ->> 'per_ms')::bigint = k.per_ms
           AND ({{row}}.partition_tally ->> 'since')::float8 <= {{now_ms}} - k.per_ms AS whole
) AS a
CROSS JOIN LATERAL (
    SELECT COALESCE(
               cardinality({{row}}.partition_slots) = {{slot_count}}
               AND ({{row}}.partition_tally ->> 'slots_at')::bigint
                   = ({{row}}.partition_tally ->> 'bucket')::bigint
               AND u.untracked >= 0
               AND jsonb_typeof({{row}}.partition_tally -> 'slot_before') = 'number',
               false) AS kept,
           u.untracked
    FROM (SELECT ({{row}}.partition_tally ->> 'jobs')::bigint
                 - ({{row}}.partition_tally ->> 'slots_jobs')::bigint AS untracked) AS u
) AS v
