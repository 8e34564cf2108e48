-- Whether {{slots}}, a queue's counts of the jobs its limited claims put in flight per slot of
-- partition keys (the column counted_slots), is whole: one dimension numbered from 1,
-- {{flight_slot_count}} counts, none NULL. Anything else (NULL before set_limits.sql starts it,
-- or an edit by hand or a restore's) is no count at all: a claim ahead does not rely on it
-- (claim_ahead.sql), and the next claim that counts starts it again from its own jobs
-- (claim_logged.sql, claim_ahead.sql; set_limits.sql from zeros).
COALESCE(array_ndims({{slots}}) = 1 AND array_lower({{slots}}, 1) = 1
         AND cardinality({{slots}}) = {{flight_slot_count}}
         AND array_position({{slots}}, NULL) IS NULL, false)
