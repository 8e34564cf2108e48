-- The rate per partition, cheaper while the whole queue stays under it. partition_tally counts
-- the queue's claimed jobs in fixed windows of the rate's length ({"per_ms", "since", "bucket",
-- "jobs", "before"}: the window's length it counts by, since when, in epoch milliseconds, the
-- number of the window it counts, floor(ms / per_ms), its jobs, and those of the window before):
-- a sliding window covers at most two of them, so their sum bounds the starts of every one of
-- the queue's partitions. While that bound leaves room for a whole claim, no partition can go
-- over its rate, and the claim reads no partition's log: it writes one row here instead, the
-- jobs it took of each partition ("{{table}}_claim_starts", keyed by the queue's claims
-- counter). Once the bound no longer leaves room, a claim first folds those rows into the
-- partitions' logs ("{{table}}_starts"), under the queue's lock, and counts per partition again.
ALTER TABLE "{{table}}_queues"
    ADD COLUMN IF NOT EXISTS partition_tally jsonb;

CREATE TABLE IF NOT EXISTS "{{table}}_claim_starts" (
    queue  text     NOT NULL,
    claim  bigint   NOT NULL,
    at_ms  float8   NOT NULL,
    keys   text[]   NOT NULL,
    jobs   bigint[] NOT NULL,
    PRIMARY KEY (queue, claim)
);
