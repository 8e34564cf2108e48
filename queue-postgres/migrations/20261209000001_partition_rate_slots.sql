-- The rate per partition, cheaper while each partition stays under it although the queue's
-- sum does not. partition_slots counts the queue's partitioned jobs claimed in the tally's
-- current window per slot of their partition keys (512 slots, by hashtextextended of the key;
-- element slot + 1): a partition's starts within a sliding window are at most its slot's count
-- plus the highest count of a slot in the window before (the tally's "slot_before"), so a claim
-- whose picks leave room in each of their slots reads no partition's log. Stored PLAIN (inline,
-- never compressed: 2 KB read and written whole by a claim), and the row kept whole up to 8 KB
-- (toast_tuple_target): past PostgreSQL's default of 2 KB it would move the row's other large
-- values (the tally, the rate's log) out of line, a write to the TOAST table on every claim.
-- NULL without a rate per partition, or for the rest of a window a release without it opened.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_slots integer[];

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN partition_slots SET STORAGE PLAIN;

ALTER TABLE "{{table}}_queues" SET (toast_tuple_target = 8160);
