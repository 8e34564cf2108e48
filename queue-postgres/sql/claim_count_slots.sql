-- How a limited claim counts the jobs it puts in flight per slot of partition keys: the SET
-- items counted_slots and slotted_claims of its UPDATE of "{{table}}_queues" AS c
-- (claim_logged.sql and claim_ahead.sql render this in place of their count_slots token).
-- Tokens: added, the claim's jobs per slot (an array of all {{flight_slot_count}} slots in
-- order, computed before the row's lock is waited for: a CTE runs once), and counts, whether
-- the claim counts at all (it took jobs). With max_per_partition the running totals go on,
-- summed in one pass of both arrays, and the claim counts itself as one that counted in them.
-- Counts not whole (claim_slots_whole.sql) start again from the claim's own, and that claim is
-- not counted in slotted_claims: a claim ahead whose snapshot holds the old counts must not
-- subtract them from the new.
counted_slots = CASE WHEN c.max_per_partition IS NULL OR NOT {{counts}} THEN c.counted_slots
    WHEN NOT {{row_slots_whole}} THEN {{added}}
    ELSE ARRAY(SELECT a + b FROM unnest(c.counted_slots, {{added}}) WITH ORDINALITY AS t(a, b, i)
               ORDER BY i)
END,
slotted_claims = c.slotted_claims
                 + CASE WHEN c.max_per_partition IS NOT NULL AND {{counts}} AND {{row_slots_whole}}
                        THEN 1 ELSE 0 END
