-- The jobs a queue's limited claims put in flight, counted per slot of their partition keys
-- while the queue has max_per_partition: 128 slots by hashtextextended of the key
-- (claim_slot.sql; element slot + 1), each the running total of the slot's jobs claimed that
-- were not in flight before (takeovers add none), and slotted_claims, the claims that counted
-- in them. A claim whose snapshot predates claims that committed while it ran bounds each
-- partition's jobs in flight by the snapshot's in-flight rows of the partition plus its slot's
-- total since the snapshot (claim_ahead.sql), as counted_jobs bounds the queue's, when every
-- claim since counted in them (the claims counter moved as far as slotted_claims). Stored PLAIN
-- (1 KB, inline: the row is kept whole up to 8 KB, table migration 20261209000001). NULL until
-- set_limits.sql sets max_per_partition or a claim under it counts.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS counted_slots bigint[],
    ADD COLUMN IF NOT EXISTS slotted_claims bigint NOT NULL DEFAULT 0;

ALTER TABLE "{{table}}_queues"
    ALTER COLUMN counted_slots SET STORAGE PLAIN;
