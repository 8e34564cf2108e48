-- The slot of one partition key ({{key}}) in the tally of the rate per partition: 0 to
-- {{slot_mask}} (its count is element slot + 1 of the column partition_slots), by PostgreSQL's
-- extended hash of text, which hash-partitioned tables rely on staying the same across
-- versions and upgrades (a slot that moved would count a partition's starts in another slot).
-- Rendered in place of a slot token by claim_logged.sql, which counts the claim's jobs per
-- slot, and claim_rated.sql, which reads the slots of a claim's picks.
(hashtextextended({{key}}, 0) & {{slot_mask}})::integer
