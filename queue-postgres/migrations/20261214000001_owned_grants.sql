-- Grants that own partitions (docs/adr/0004-room-grants.md, "Grants that own shards"): a grant
-- of a queue with a small max_per_partition and no rate per partition owns some of the 64
-- shards of partition keys (a bit each, the shard of a key its extended hash's low six bits)
-- while its row lives. No other claim or grant puts a job of an owned shard's partitions in
-- flight meanwhile, so the grant's claims count those partitions' jobs in flight exactly, from
-- their own snapshot, and any limit per partition, 1 included, serves. NULL: a grant of room
-- in every partition (per_claim of any one a claim), as before.
ALTER TABLE "{{table}}_grants"
    ADD COLUMN IF NOT EXISTS shards bigint CHECK (shards <> 0);
