-- The tally per slot of partition keys of the rate per partition (the framework's table
-- migration 20261209000001): each partition's starts bounded by its slot's count, so a queue
-- of many partitions under their rate reads no partition's log although its sum is over it.
-- Stored PLAIN: read and written whole by every claim of a queue with a rate per partition;
-- the row kept whole up to 8 KB, so that its other values are not moved out of line.
ALTER TABLE "receipt_jobs_queues"
    ADD COLUMN IF NOT EXISTS partition_slots integer[];

ALTER TABLE "receipt_jobs_queues"
    ALTER COLUMN partition_slots SET STORAGE PLAIN;

ALTER TABLE "receipt_jobs_queues" SET (toast_tuple_target = 8160);
