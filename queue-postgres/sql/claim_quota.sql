-- The quota of a claim of a queue with limits (claim_limited.sql and claim_turns.sql render it
-- in place of their claim_quota token, first; claim_limited.sql says what it guarantees).
-- Parameters as claim.sql's. CTEs: control, the queue's controls row, locked (FOR UPDATE, which
-- returns the row as the last claim to hold it committed it); seen, the same row as this
-- statement's snapshot has it; quota: whether the snapshot is stale (a limited claim committed
-- after it), how many new jobs and how many jobs in all the claim may take (0 when stale or
-- when it must fold first), the queue's max_per_partition and its partition cursor, whether
-- any limit per partition is set (partitioned), the rate per partition as the claim
-- applies it (key_rate_starts and key_rate_per_ms: NULL without one, and NULL while the
-- queue's tally leaves room for the whole claim, unbound: then no partition can go over its
-- rate and none is read), its window whenever the queue has one (tally_per_ms), whether claims
-- made while unbound must be folded into the partitions' logs before this one counts them
-- (must_fold: the statement then claims nothing and says so; fold_starts.sql folds; with the
-- after_pick token true, claim_limited.sql's, never here: claim_rated.sql decides it once the
-- pick is known), the tally per slot of partition keys (slots_kept: it counts the tally's
-- window; slots_usable: it bounds every partition's starts within the sliding window,
-- slot_base plus the partition's slot's count in slot_counts), and the
-- time the claim counts by (now_at, and now_ms in epoch milliseconds: clock_timestamp once
-- the lock is held, one instant for the whole statement), whether the lean form of
-- claim_limited.sql (rendered with the lean token true) refuses the queue because it has limits
-- per partition (refused: it then claims nothing and says so); held, with max_per_partition, the
-- queue's jobs in flight per partition key (every in-flight row counts, as for max_in_flight),
-- one read of the in-flight rows made a jsonb object, read by key in O(log n) (claim_turns.sql
-- reads it; claim_limited.sql counts its picks another way, and an unread CTE never runs).
--
-- The tally (partition_tally, table migration 20261208000001) counts the queue's partitioned
-- jobs claimed in fixed windows of the rate's length: any sliding window lies within the
-- current one and the one before, so their sum bounds every partition's starts within it, once
-- the tally has counted for a whole window (since). Another window length makes the tally start
-- again (not unbound for a window); while the clock is behind the tally's window (it stepped
-- back), the claims count per partition.
--
-- The queue also counts those jobs per slot of their partition keys (claim_slot.sql) in the
-- tally's window: partition_slots (table migration 20261209000001), kept while the tally's
-- slots_at is its window; the tally's slots_jobs says how many of its jobs the slots counted.
-- The rest (untracked: claims the tally's sum left room for, which skip the slots, and claims
-- of a release without them, which move jobs but not slots_jobs) may be in any slot, so every
-- slot is charged them. The tally's slot_before bounds every slot of the window before (its
-- highest count plus its untracked jobs; that window's jobs when its slots were not kept). A
-- partition's starts within the sliding window are at most its slot's count plus slot_base,
-- so a claim whose picks leave room in each of their slots cannot put a partition over its
-- rate, although the queue's sum could (claim_rated.sql).
--
-- Room granted to queue handles (room_grants on; grant.sql, table migration 20261212000001)
-- is taken off the limits the claim applies: max_in_flight less the grants' jobs_left, and
-- max_per_partition less the least of their per_claim * claims_left and jobs_left (a grant's
-- claims may each put per_claim of any one partition in flight, and no more than its jobs), every grant counted until its row is deleted, expired
-- or not. The grants are read from the statement's snapshot, which, unless stale, is younger
-- than every grant (a grant moves the claims counter): a claim on a grant that committed since
-- moved its jobs from the grant's jobs_left, which the snapshot counts, into the in-flight
-- rows, which it does not, so the sum is never short. grant.sql leaves both limits at least 1.
-- The rate needs nothing here: grant.sql logs each grant in the rate's log as all its jobs
-- started at its expiry instant, so the log this claim counts holds them.
control AS MATERIALIZED (
    SELECT CASE WHEN c.room_grants AND c.max_in_flight IS NOT NULL
                THEN c.max_in_flight - (SELECT COALESCE(sum(g.jobs_left), 0)::bigint
                                        FROM "{{table}}_grants" AS g WHERE g.queue = $1)
                ELSE c.max_in_flight END AS max_in_flight,
           c.rate_starts, c.rate_per_ms, c.rate_log, c.claims,
           CASE WHEN c.room_grants AND c.max_per_partition IS NOT NULL
                THEN c.max_per_partition
                     - (SELECT COALESCE(sum(LEAST(g.per_claim::bigint * g.claims_left, g.jobs_left)), 0)::bigint
                        FROM "{{table}}_grants" AS g WHERE g.queue = $1)
                ELSE c.max_per_partition END AS max_per_partition,
           c.partition_cursor, c.partition_rate_starts,
           c.partition_rate_per_ms, c.partition_tally, c.partition_slots
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
    FOR UPDATE
),
seen AS MATERIALIZED (
    SELECT claims FROM "{{table}}_queues" WHERE queue = $1
),
quota AS MATERIALIZED (
    SELECT c.claims IS DISTINCT FROM (SELECT claims FROM seen) AS stale,
           CASE WHEN c.claims IS DISTINCT FROM (SELECT claims FROM seen) OR f.must_fold
                     OR l.refused THEN 0
           -- Without max_in_flight, no count: NULL minus a subquery still runs the subquery.
           WHEN c.max_in_flight IS NULL THEN r.room
           ELSE LEAST(GREATEST(0, c.max_in_flight - (
                    SELECT count(*) FROM "{{table}}" AS j
                    WHERE j.queue = $1 AND j.status = 'in_flight')),
                    r.room)
           END AS new_jobs,
           CASE WHEN c.claims IS DISTINCT FROM (SELECT claims FROM seen) OR f.must_fold
                     OR l.refused THEN 0
           ELSE r.room END AS all_jobs,
           c.max_per_partition AS per_partition,
           c.partition_cursor AS cursor_key,
           (c.max_per_partition IS NOT NULL OR g.per_ms IS NOT NULL) AS partitioned,
           CASE WHEN NOT g.unbound THEN c.partition_rate_starts END AS key_rate_starts,
           CASE WHEN NOT g.unbound THEN g.per_ms END AS key_rate_per_ms,
           g.per_ms AS tally_per_ms,
           g.unbound,
           f.must_fold,
           g.kept AS slots_kept,
           g.usable AS slots_usable,
           g.slot_base,
           g.slot_counts,
           l.refused,
           t.now_at,
           t.now_ms
    FROM control AS c
    CROSS JOIN LATERAL (
        -- The lean form of claim_limited.sql ({{lean}} true) leaves the partitions out: it
        -- claims nothing from a queue with limits per partition and says so.
        SELECT {{lean}} AND (c.max_per_partition IS NOT NULL
                             OR (c.partition_rate_starts IS NOT NULL
                                 AND c.partition_rate_per_ms IS NOT NULL)) AS refused
    ) AS l
    CROSS JOIN LATERAL (
        SELECT x.at AS now_at, extract(epoch FROM x.at)::float8 * 1000 AS now_ms
        FROM (SELECT clock_timestamp() AS at) AS x
    ) AS t
    -- The tally and its slots at the claim's instant, for the batch asked (claim_tally.sql).
    CROSS JOIN LATERAL (
{{tally}}
    ) AS g
    CROSS JOIN LATERAL (
        -- (Never in the lean form, which refuses a queue with a rate per partition: the
        -- constant lets the planner drop the read of "{{table}}_claim_starts".)
        SELECT NOT {{lean}} AND NOT {{after_pick}} AND g.per_ms IS NOT NULL AND NOT g.unbound
               AND {{to_fold}}
               AS must_fold
    ) AS f
    CROSS JOIN LATERAL (
        SELECT CASE WHEN c.rate_starts IS NULL OR c.rate_per_ms IS NULL THEN $2::bigint
               ELSE GREATEST(0, LEAST($2::bigint, c.rate_starts - (
                   SELECT COALESCE(sum((e ->> 1)::bigint), 0)
                   FROM jsonb_array_elements(c.rate_log) AS e
                   -- At the claim's instant (its claimed_at), not a later clock: an entry
                   -- within the window ending there must count.
                   WHERE (e ->> 0)::float8 > t.now_ms - c.rate_per_ms)))
               END AS room
    ) AS r
    UNION ALL
    SELECT false, $2::bigint, $2::bigint, NULL::integer, NULL::text, false, NULL::integer,
           NULL::bigint, NULL::bigint, false, false, false, false, NULL::bigint, NULL::integer[],
           false, clock_timestamp(),
           extract(epoch FROM clock_timestamp())::float8 * 1000
    WHERE NOT EXISTS (SELECT 1 FROM control)
),
held AS MATERIALIZED (
    SELECT COALESCE(jsonb_object_agg(k.key, k.n), '{}') AS counts
    FROM (SELECT j.partition_key AS key, count(*) AS n
          FROM "{{table}}" AS j
          WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL
            AND (SELECT per_partition FROM quota) IS NOT NULL
          GROUP BY j.partition_key) AS k
)
