-- How a claim counts its jobs in the queue's tally of its rate per partition and the tally's
-- slots (partition_tally and partition_slots, claim_quota.sql says what they bound): the SET
-- item of its UPDATE of "{{table}}_queues" AS c that writes both, from one read of the quota
-- (claim_logged.sql and claim_ahead.sql render this in place of their count_tally token).
-- Tokens: added, the claim's partitioned jobs per slot (claim_tally_claims.sql, computed
-- before the row's lock is waited for); quota, a subquery of one row read as q: tally_per_ms
-- (NULL without a rate per partition: both columns NULL), now_ms, the instant the claim counts
-- by (the tally keeps it as 'at'), slots_kept and unbound (claim_tally.sql's kept and unbound
-- at that instant); fits, whether the claim may count at all (claim_ahead.sql's check at the
-- same instant; true under the lock, where the quota already bounded the claim), and over, the
-- text of the error a claim that does not fit fails with (a cast of it, made of the claim's job
-- count so that the planner cannot fold it into a constant and raise it while planning).
(partition_tally, partition_slots) = (
    SELECT CASE
               WHEN q.tally_per_ms IS NULL THEN NULL
               WHEN NOT n.any THEN c.partition_tally
               WHEN NOT {{fits}} THEN ('{{over}} with ' || n.all_jobs || ' jobs')::bigint::text::jsonb
               -- Each claim counted leaves its instant as 'at': the instant the rate counts it
               -- by (a claim ahead's claimed_at is earlier; data-model.md).
               ELSE (CASE
               -- No tally, or another window length: start again.
               WHEN (c.partition_tally ->> 'per_ms')::bigint IS DISTINCT FROM q.tally_per_ms
               THEN jsonb_build_object('per_ms', q.tally_per_ms, 'since', q.now_ms,
                                       'bucket', b.bucket, 'jobs', n.jobs, 'before', 0,
                                       'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                       'slot_before', 0)
               -- The clock stepped back: counted in the window the tally is at, never
               -- forgotten (the claims before the step stay counted when it is put right;
               -- claim_quota.sql counts per partition until the clock is back there).
               -- The slots count the claim unless the tally's sum left room for it.
               WHEN b.bucket <= (c.partition_tally ->> 'bucket')::bigint
               THEN c.partition_tally
                    || jsonb_build_object('jobs', (c.partition_tally ->> 'jobs')::bigint + n.jobs)
                    || CASE WHEN q.slots_kept AND NOT q.unbound
                            THEN jsonb_build_object(
                                     'slots_jobs',
                                     (c.partition_tally ->> 'slots_jobs')::bigint + n.jobs)
                            ELSE '{}' END
               -- The next window: the tally's becomes the one before.
               WHEN b.bucket = (c.partition_tally ->> 'bucket')::bigint + 1
               THEN c.partition_tally
                    || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs,
                                          'before', (c.partition_tally ->> 'jobs')::bigint,
                                          'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                          'slot_before', CASE WHEN q.slots_kept
                                              THEN (SELECT COALESCE(max(e), 0)
                                                    FROM unnest(c.partition_slots) AS e)
                                                   + (c.partition_tally ->> 'jobs')::bigint
                                                   - (c.partition_tally ->> 'slots_jobs')::bigint
                                              ELSE (c.partition_tally ->> 'jobs')::bigint
                                              END)
               ELSE c.partition_tally
                    || jsonb_build_object('bucket', b.bucket, 'jobs', n.jobs, 'before', 0,
                                          'slots_at', b.bucket, 'slots_jobs', n.jobs,
                                          'slot_before', 0)
               END) || jsonb_build_object('at', q.now_ms)
           END,
           -- Rewritten whole ({{slot_count}} counts) when the claim counts in them: not while the
           -- tally's sum left room for the claim (its jobs then stay untracked, charged to
           -- every slot), which keeps a queue far under its rate from paying for them. In the
           -- tally's window (or behind it) the counts go on; a new window, or a new tally,
           -- starts from this claim's.
           CASE
               WHEN q.tally_per_ms IS NULL THEN NULL
               WHEN NOT n.any THEN c.partition_slots
               WHEN w.same AND NOT q.slots_kept THEN NULL
               WHEN w.same AND q.unbound THEN c.partition_slots
               WHEN w.same
               THEN ARRAY(SELECT COALESCE(t.counted, 0) + t.added
                          FROM unnest(c.partition_slots, {{added}}) WITH ORDINALITY
                               AS t(counted, added, i)
                          ORDER BY i)
               ELSE {{added}}
           END
    FROM {{quota}} AS q
    -- Without a rate per partition nothing is read: the condition on q alone is checked once,
    -- before claimed is (both columns are then NULL).
    CROSS JOIN LATERAL (SELECT count(*) > 0 AS any, count(*) AS all_jobs,
                               count(*) FILTER (WHERE partition_key IS NOT NULL) AS jobs
                        FROM claimed
                        WHERE q.tally_per_ms IS NOT NULL) AS n
    CROSS JOIN LATERAL (SELECT floor(q.now_ms / q.tally_per_ms)::bigint AS bucket) AS b
    CROSS JOIN LATERAL (
        SELECT (c.partition_tally ->> 'per_ms')::bigint IS NOT DISTINCT FROM q.tally_per_ms
               AND b.bucket <= (c.partition_tally ->> 'bucket')::bigint AS same
    ) AS w
)
