-- The rate per partition, cheaper while each partition stays under it although the queue's
-- sum does not. partition_slots counts the queue's partitioned jobs claimed in the tally's
-- current window per slot of their partition keys (512 slots, by hashtextextended of the key;
-- element slot + 1): a partition's starts within a sliding window are at most its slot's count
-- plus the highest count of a slot in the window before (the tally's "slot_before"), so a claim
-- whose picks leave room in each of their slots reads no partition's log. Stored PLAIN (inline,
-- never compressed: 2 KB read once and written once per claim). NULL while not kept (the rate
-- unset, or claims of a release without it counted in the window).
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_slots integer[];

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN partition_slots SET STORAGE PLAIN;
