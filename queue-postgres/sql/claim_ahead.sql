-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits (max_in_flight, the rate, max_per_partition, the
-- rate per partition) while they leave ample room, without waiting for the queue's row first
-- (its first line is claim.sql's, so that a drain finds it running).
--
-- Parameters: claim.sql's $1 to $7 ($2 the batch the claimer asks for); $8 the margin, how
-- many claims of that batch the room must leave space for (the queue handle widens it while
-- claims ahead fail: the claims committing while one runs use it up, and they are the more
-- the more workers claim).
--
-- Why: claim_limited.sql holds the queue's row lock for its whole pick and write, so the
-- claims of several workers take turns even when the limits are far from binding. This form
-- reads the row unlocked (seen, its snapshot's version) and claims while the room it shows
-- leaves space for $8 claims of the batch asked for (ahead.ample, and fit for the limits per
-- partition), in parallel with the other claims, as claim.sql does; only its last
-- write takes the row's lock, to check the limits and count the claim (logged). When the room
-- is not ample it claims nothing and returns a row marked 'binding': claim with
-- claim_limited.sql then.
--
-- max_per_partition: the picks go ahead (fit) when each picked partition's jobs in flight
-- (held, the snapshot's) plus its picks leave room for $8 times the picks of its slot of
-- partition keys (claims that commit meanwhile and pick alike add about that much to the
-- slot). Jobs without a partition key are not limited per partition.
--
-- The rate per partition: the picks go ahead (rate_room) when the snapshot's tally
-- (claim_tally.sql, claim_quota.sql says how it bounds a partition's starts) leaves room for
-- $8 claims of the batch in its sum, or for $8 times each picked slot's picks in the slot. At
-- the end the claim is bounded by the newest row's tally alone, which counts every claim
-- committed since (no snapshot is needed): read once, at one instant, by the SET that counts
-- the claim in it (claim_count_tally.sql, the multi-column assignment of
-- partition_tally and partition_slots), which fails the claim unless its jobs, takeovers
-- included (tally_claims), fit the tally's sum or each of their slots. A claim that fits is
-- logged as a claim under the lock whose tally left room for it: one row of
-- "{{table}}_claim_starts" (claim_started; folded into the partitions' logs when a claim must
-- count per partition, fold_starts.sql), and every 64th claim prunes the rows that left the
-- window; the partitions' own logs ("{{table}}_starts") are written and pruned by claims
-- under the lock only. The instant is read once the claim holds the row's lock (row_locked).
--
-- Guarantees: claim.sql's, and claim_limited.sql's for max_in_flight, the rate,
-- max_per_partition and the rate per partition (the limits, not the turns: far from the limit
-- the partitions need none, and the jobs are taken in claim order, as claim_limited.sql's own
-- pick does), the rates by the instants they count each claim at: a claim under the lock, the
-- instant after its lock, which it stamps as claimed_at; a claim ahead, the instant its last
-- write reads once it holds the row's lock (row_locked). The check runs on the
-- row as the last claim to hold it committed it (an UPDATE reads the newest version of a row
-- it waited for). The queue's jobs in flight are at most the snapshot's in-flight rows, plus
-- the jobs the claims that committed since put in flight (the row's counted_jobs since the
-- snapshot's; table migration 20261210000001), plus this claim's new jobs; the claims that
-- committed since each counted theirs when the row's claims counter moved as far as
-- counted_claims (a claim of a release without those columns moves claims alone: then the
-- check fails; so does a change of the limits, set_limits.sql).
-- With max_per_partition a claim also counts its new jobs (or its picks, which include them)
-- per slot of their partition keys (counted_slots, table migration 20261211000001: running
-- totals of 128 slots, claim_slot.sql) and itself in slotted_claims; when the row's claims
-- counter moved as far as slotted_claims since the snapshot (a claim of a release, or a build,
-- without the count, or a claim while the queue had no max_per_partition, moves claims alone:
-- then the check fails), a partition's jobs in flight are at most its snapshot's in-flight rows
-- plus its slot's total since the snapshot plus this claim's picks of it, which must stay
-- within the limit. Counts not whole (claim_slots_whole.sql) fail it too, and so does a claim
-- that started them again since the snapshot (it does not move slotted_claims; set_limits.sql
-- moves claims when it does). The counts are trusted as the claims write them: a row put back
-- from an older backup while claims run is not detected. The rate counts the row's log of
-- starts at the moment of the check, and logs the claim at it (clock_timestamp read in the
-- update's WHERE and SET, evaluated once the claim holds the row's lock (row_locked, which
-- waits for it first), and again on the newest version when a claim updated the row
-- meanwhile: a value read in its FROM would be the instant it began to wait, and miss entries
-- that claim pruned). Every claim of the queue checks under the row's lock, so no two pass the
-- check on the same room. The claim's own rows are written
-- before the check: their claimed_at, and the lease counted from it, is the statement's start
-- (now()), earlier than the instant the rates count the claim by, by the statement's run and
-- its wait for the lock (a row is written once per statement): read by claimed_at, a rate may
-- show more starts within a window than it allows, by that drift.
--
-- A queue whose switch room_grants is on (room may be granted to queue handles: grant.sql)
-- gets no claim ahead: its snapshot shows it 'binding',
-- and the check at the end fails on the newest row, since this form does not count the room
-- granted in flight (the lock's claims do, claim_quota.sql).
--
-- A claim that fails the check must not commit, and a statement cannot undo its own writes; an
-- error can: the statement then fails with SQLSTATE 22P02 and a message naming {{over}} (a
-- cast of that text, made of the claim's job count so that the planner cannot fold it into a
-- constant and raise it while planning).
-- Nothing it wrote stays; the caller claims again under the lock. It is rare: the claims that
-- committed while this one ran must have used up the margin.
WITH seen AS MATERIALIZED (
    SELECT c.max_in_flight, c.rate_starts, c.rate_per_ms, c.rate_log, c.claims,
           c.counted_claims, c.counted_jobs, c.max_per_partition, c.counted_slots,
           c.slotted_claims, c.partition_rate_starts, c.partition_rate_per_ms, c.partition_tally,
           c.partition_slots,
           -- A rate of the queue or per partition: limits counted by the clock (row_locked).
           (c.rate_starts IS NOT NULL AND c.rate_per_ms IS NOT NULL)
           OR (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL)
               AS timed,
           {{granting}} AS granting
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
),
ahead AS MATERIALIZED (
    SELECT (s.max_in_flight IS NULL OR s.max_in_flight - n.in_flight >= $8::bigint * $2::bigint)
           AND (s.rate_starts IS NULL OR s.rate_per_ms IS NULL
                OR s.rate_starts - (
                       SELECT COALESCE(sum((e ->> 1)::bigint), 0)
                       FROM jsonb_array_elements(s.rate_log) AS e
                       WHERE (e ->> 0)::float8
                             > extract(epoch FROM clock_timestamp())::float8 * 1000
                               - s.rate_per_ms) >= $8::bigint * $2::bigint)
           AND NOT s.granting AS ample,
           n.in_flight,
           s.max_per_partition,
           CASE WHEN s.partition_rate_starts IS NOT NULL THEN s.partition_rate_per_ms END
               AS partition_rate_per_ms
    FROM seen AS s
    CROSS JOIN LATERAL (
        -- Without max_in_flight, no count (a CASE runs its subquery only when it is read).
        SELECT CASE WHEN s.max_in_flight IS NOT NULL THEN (
                   SELECT count(*) FROM "{{table}}" AS j
                   WHERE j.queue = $1 AND j.status = 'in_flight') END AS in_flight
    ) AS n
),
take AS MATERIALIZED (
    SELECT CASE WHEN COALESCE((SELECT ample FROM ahead), false) THEN $2::bigint ELSE 0 END AS jobs
),
plain AS MATERIALIZED (
{{claim_due}}
),
rate_room AS MATERIALIZED (
    -- With a rate per partition: whether the snapshot's tally (claim_tally.sql, at the
    -- statement's instant) leaves room for the margin's claims: its sum for $8 claims of the
    -- batch, or the slot of each picked job's partition for $8 times that slot's picks (claims
    -- that commit meanwhile and pick alike add about that much to it). Takeovers are left to
    -- the check at the end, which counts them. Read only with a rate per partition.
    SELECT g.unbound
           -- Jobs without a partition key are not limited per partition.
           OR NOT EXISTS (SELECT 1 FROM plain AS p WHERE p.partition_key IS NOT NULL)
           OR (g.usable
               AND NOT EXISTS (
                       SELECT 1
                       FROM (SELECT {{rate_slot_pick}} AS slot, count(*) AS picks
                             FROM plain AS p
                             WHERE p.partition_key IS NOT NULL
                             GROUP BY 1) AS p
                       WHERE (g.slot_base + g.slot_counts[p.slot + 1] + $8::bigint * p.picks
                              > s.partition_rate_starts) IS NOT FALSE)) AS ok
    FROM seen AS s
    CROSS JOIN LATERAL (
{{snapshot_tally}}
    ) AS g
),
held AS MATERIALIZED (
    -- Each picked partition's jobs in flight in the snapshot, its picks and its slot of
    -- partition keys: one aggregate over the picks and the queue's in-flight rows by key (a
    -- join of the two is planned on the in-flight rows' estimate, one row, and compares every
    -- pair). Read only for a bound per partition: a CTE nobody reads never runs.
    SELECT u.key, count(*) FILTER (WHERE NOT u.pick) AS n, count(*) FILTER (WHERE u.pick) AS picks,
           {{flight_slot_held}} AS slot
    FROM (SELECT p.partition_key AS key, true AS pick
          FROM plain AS p
          WHERE p.partition_key IS NOT NULL
          UNION ALL
          SELECT j.partition_key, false
          FROM "{{table}}" AS j
          WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL) AS u
    GROUP BY u.key
    HAVING bool_or(u.pick)
),
slot_picks AS MATERIALIZED (
    -- The picks per slot, all slots in order (an array read by slot number): what fit weighs
    -- each partition's margin by, and what the claim adds to the row's counts per slot when it
    -- is written. Every new job of a partition is one of its picks; a pick not taken (a
    -- takeover took its place in the batch) is counted too, which only makes the check and
    -- later claims' bounds more cautious, never wrong.
    SELECT array_agg(COALESCE(k.picks, 0)::bigint ORDER BY i) AS picks
    FROM generate_series(1, {{flight_slot_count}}) AS i
    LEFT JOIN (SELECT slot, sum(picks) AS picks FROM held GROUP BY slot) AS k ON k.slot + 1 = i
),
fit AS MATERIALIZED (
    -- Whether the picks go ahead: the room is ample and, with max_per_partition, each picked
    -- partition's jobs in flight plus its picks leave room for the margin's claims of as many
    -- jobs as its slot of partition keys got in this pick (claims that commit meanwhile and
    -- pick alike would add about that much to the slot). The row's counts per slot are needed
    -- for the check at the end (set_limits.sql starts them).
    SELECT (SELECT jobs FROM take) > 0
           AND (a.max_per_partition IS NULL
                OR NOT EXISTS (
                       SELECT 1
                       FROM held AS h
                       WHERE NOT {{seen_slots_whole}}
                          OR (h.n + h.picks
                              + $8::bigint * (SELECT picks FROM slot_picks)[h.slot + 1]
                              > a.max_per_partition) IS NOT FALSE))
           AND (a.partition_rate_per_ms IS NULL OR (SELECT ok FROM rate_room))
               AS ok
    FROM ahead AS a
),
due AS MATERIALIZED (
    SELECT * FROM plain WHERE (SELECT ok FROM fit)
),
{{claim_picks}},
tally_claims AS MATERIALIZED (
{{tally_claims}}
),
row_locked AS MATERIALIZED (
    -- With a rate (of the queue or per partition, as the snapshot shows them), the queue's
    -- row, locked once the claim has jobs, before logged computes its update: logged's WHERE
    -- reads it (an uncorrelated EXISTS, evaluated before any value of the update), so
    -- whatever held the row meanwhile, the clock its checks and counts read comes after the
    -- wait for the row.
    -- Without it, a wait for a row only locked, not written, meanwhile would keep the values
    -- the update computed before the wait (PostgreSQL computes them again only for a row
    -- written meanwhile), and the rates would count the claim at the instant the wait began,
    -- earlier than its jobs start by the wait. Limits without a clock need no such step (it
    -- would hold the row while the update computes): a rate set since the snapshot moved the
    -- row's claims counter (set_limits.sql), which fails the check.
    SELECT c.queue
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1
      AND EXISTS (SELECT 1 FROM claimed)
      AND (SELECT timed FROM seen)
    FOR UPDATE
),
logged AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + 1,
        -- This release counts room grants (table migration 20261213000001, the fence).
        grants_counted = NOT c.grants_counted,
        counted_claims = c.counted_claims + 1,
        counted_jobs = c.counted_jobs + n.new_jobs,
        {{count_slots}},
        {{count_tally}},
        rate_log = CASE WHEN c.rate_starts IS NULL OR c.rate_per_ms IS NULL THEN '[]'::jsonb
            ELSE COALESCE((SELECT jsonb_agg(e) FROM jsonb_array_elements(c.rate_log) AS e
                           WHERE (e ->> 0)::float8
                                 > extract(epoch FROM clock_timestamp())::float8 * 1000
                                   - c.rate_per_ms), '[]')
                 || jsonb_build_array(jsonb_build_array(
                        extract(epoch FROM clock_timestamp())::float8 * 1000, n.all_jobs))
        END
    FROM seen AS s,
         ahead AS a,
         (SELECT count(*) FILTER (WHERE NOT taken_over) AS new_jobs, count(*) AS all_jobs
          FROM claimed) AS n
    WHERE c.queue = $1
      AND (NOT s.timed OR EXISTS (SELECT 1 FROM row_locked))
      AND n.all_jobs > 0
      AND NOT {{granting}}
      AND c.claims - s.claims = c.counted_claims - s.counted_claims
      AND (c.max_in_flight IS NULL
           OR a.in_flight + (c.counted_jobs - s.counted_jobs) + n.new_jobs <= c.max_in_flight)
      AND (c.max_per_partition IS NULL
           OR NOT EXISTS (
                  -- Unknown binds: a count missing fails the check, never passes it.
                  SELECT 1
                  FROM held AS h
                  WHERE c.claims - s.claims IS DISTINCT FROM c.slotted_claims - s.slotted_claims
                     OR NOT {{snapshot_slots_whole}}
                     OR NOT {{row_slots_whole}}
                     OR (h.n + h.picks
                         + (c.counted_slots[h.slot + 1] - s.counted_slots[h.slot + 1])
                         > c.max_per_partition) IS NOT FALSE))
      AND (c.rate_starts IS NULL OR c.rate_per_ms IS NULL
           OR (SELECT COALESCE(sum((e ->> 1)::bigint), 0)
               FROM jsonb_array_elements(c.rate_log) AS e
               WHERE (e ->> 0)::float8
                     > extract(epoch FROM clock_timestamp())::float8 * 1000 - c.rate_per_ms)
               + n.all_jobs <= c.rate_starts)
    RETURNING c.claims, c.partition_rate_per_ms,
              (c.partition_rate_starts IS NOT NULL AND c.partition_rate_per_ms IS NOT NULL)
                  AS rated
),
claim_started AS (
    -- With a rate per partition, the claim's jobs per partition in one row of
    -- "{{table}}_claim_starts", numbered by the claims counter it left, as a claim under the
    -- lock logs a claim its tally leaves room for (claim_logged_partitions.sql); stamped after
    -- the tally counted it (a later stamp keeps it in the windows a little longer, never
    -- shorter).
    INSERT INTO "{{table}}_claim_starts" (queue, claim, at_ms, keys, jobs)
    SELECT $1, l.claims, extract(epoch FROM clock_timestamp())::float8 * 1000,
           array_agg(k.key), array_agg(k.jobs)
    FROM logged AS l
    CROSS JOIN (SELECT partition_key AS key, count(*) AS jobs
                FROM claimed
                WHERE partition_key IS NOT NULL
                GROUP BY 1) AS k
    WHERE l.rated
    GROUP BY l.claims
),
claim_starts_pruned AS (
    -- Every 64th claim of the queue, the rows whose claim left the window, as a claim under
    -- the lock prunes them.
    DELETE FROM "{{table}}_claim_starts" AS s
    USING logged AS l
    WHERE s.queue = $1
      AND l.rated
      AND l.claims % 64 = 0
      AND s.at_ms <= extract(epoch FROM clock_timestamp())::float8 * 1000 - l.partition_rate_per_ms
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested, NULL AS marker
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       'binding'
WHERE NOT COALESCE((SELECT ok FROM fit), false)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       ('{{over}} with ' || (SELECT count(*) FROM claimed) || ' jobs')::bigint::text
WHERE EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM logged)
ORDER BY due_at, priority, id
