-- The jobs a queue's limited claims put in flight, counted per slot of their partition keys
-- while the queue has max_per_partition: 128 slots by hashtextextended of the key
-- (claim_slot.sql; element slot + 1), each the running total of the slot's jobs claimed that
-- were not in flight before (takeovers add none). A claim whose snapshot predates claims that
-- committed while it ran bounds each partition's jobs in flight by the snapshot's in-flight
-- rows of the partition plus its slot's total since the snapshot (claim_ahead.sql), as
-- counted_jobs bounds the queue's. Stored PLAIN (1 KB, inline: the row is kept whole up to
-- 8 KB, table migration 20261209000001). NULL until a claim of a queue with max_per_partition
-- counts in it.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS counted_slots bigint[];

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN counted_slots SET STORAGE PLAIN;
