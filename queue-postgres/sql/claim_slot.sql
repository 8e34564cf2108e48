-- The slot of one partition key ({{key}}) among a power of two of slots: 0 to {{slot_mask}},
-- by PostgreSQL's extended hash of text, which hash-partitioned tables rely on staying the
-- same across versions and upgrades (a slot that moved would count a partition's jobs in
-- another slot). Two counts use it: the tally of the rate per partition (512 slots, the
-- column partition_slots: claim_logged.sql counts the claim's jobs per slot, claim_rated.sql
-- reads the slots of a claim's picks), and the jobs limited claims put in flight under
-- max_per_partition (128 slots, the column counted_slots: claim_logged.sql and
-- claim_ahead.sql count them, claim_ahead.sql bounds a partition by its slot's). The count of
-- slot s is element s + 1 of its column.
(hashtextextended({{key}}, 0) & {{slot_mask}})::integer
