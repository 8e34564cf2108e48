-- Grants room to a queue handle for several claims (docs/adr/0004-room-grants.md): jobs it may
-- put in flight and claims it may make on them (claim_granted.sql), without the queue's row
-- lock, until the grant's row is deleted. Runs in the transaction of lock_queue.sql, after it,
-- so that its snapshot is younger than the lock and sees every claim and grant that held the
-- row before.
--
-- Parameters: $1 queue; $2 the holder's name (NULL for none); $3 the batch its claims ask for;
-- $4 how many claims at most; $5 the grant's life in milliseconds (the database's clock; no
-- longer than the queue's rate's window, when it has one); $6 the holder's grants spent to
-- their end, returned here (deleted; empty for none). Returns the grant, or no row when none
-- is granted: the queue's switch is off, it has no limit, it is paused, the room its limits
-- leave is too short for a batch, or its tally of the rate per partition cannot be charged
-- (below). Then claim under the lock.
--
-- The claims: $4, or fewer under max_per_partition when its share of the room is short of one
-- job of a partition for each of $4 (so that a queue with a low limit still gets grants), and
-- likewise under a rate per partition for a slot's.
--
-- The room: F, the queue's jobs in flight, and J, the jobs_left of every grant (expired or
-- not: a grant counts until its row is deleted); M, the most jobs in flight of one partition,
-- and P, the least of per_claim * claims_left and jobs_left of every grant (a claim on it
-- puts x jobs of a partition in flight, x at most per_claim and at most its new jobs, and
-- lowers that least by x or more). A grant of G jobs and $4 claims of at most
-- c jobs of one partition each keeps F + J + G <= max_in_flight and M + P + c * $4 <=
-- max_per_partition, taking at most a 1/{{grant_share}} share of what each leaves (G the
-- claims' batches, c the batch; other handles' grants take shares of the rest), and needs G of
-- at least one batch and c of at least 1 (near a limit nothing is granted). So the limits less
-- the granted room stay at least 1 (claim_quota.sql applies those). Claims that commit after
-- the snapshot move jobs from a grant's jobs_left into the in-flight rows, and finished jobs
-- only lower F: the snapshot's sums are never short. J and P leave out what the grants this
-- statement deletes had left when deleted (the delete reads each row after any claim on it
-- committed, and no claim spends it after): what their claims took since the snapshot stays
-- counted, in the snapshot's jobs_left.
--
-- The queue's rate (R starts in any window of W): S, the starts its log counts within the
-- window at the grant's instant (the lock held), and G <= (R - S)/{{grant_share}}. The grant is
-- logged as G starts at its expiry instant, ahead of time: every claim on it takes at most its
-- jobs_left jobs, takeovers included (claim_granted.sql), so at most G jobs start on it,
-- each at an instant between the grant and its expiry, and every check of the rate until W
-- after the expiry (claim_quota.sql's, the next grant's) counts all G, whatever was spent. So
-- any window's starts are counted by the last check before its end, which allowed them: the
-- starts in the window before that check are in the log (a grant's by its entry), those after
-- it can only be the unexpired grants', counted whole. The cost is the grant's jobs counted
-- for up to its life longer than their starts are: hence a life no longer than the window,
-- and none near the rate (a quarter of what is left). The entry carries the grant's id: when
-- this statement deletes the grant (spent, returned through $6, expired), the entry becomes
-- the jobs its claims took, at the least of its expiry and the delete (logged), which no claim
-- on it can start after (so does return_grant.sql); a grant deleted otherwise (the trigger, by
-- hand) keeps its entry whole.
--
-- The rate per partition (R starts of any one partition in any window of W) is bounded by the
-- queue's tally of it (claim_tally.sql, claim_quota.sql): the jobs claimed in fixed windows
-- of W, in all and per slot of partition keys, a partition's starts within the sliding window
-- at most its slot's count plus the jobs the slots did not count (untracked, charged to every
-- slot). A grant of G jobs for k claims that each start at most c jobs of any one slot
-- (per_claim, a slot's cap, which caps its partitions too; takeovers included, ranked with the
-- claim's picks) is charged to the tally whole at its instant: G to its jobs and the least of
-- c * k and G to its untracked jobs, so that every check of the tally (the claims under the
-- lock, the next grants) counts all the starts the grant's claims may make. Its c * k is at
-- most a 1/{{grant_share}} share of what the fullest slot leaves; c is three times the batch's
-- share of the slots, or half the most of one slot among the next batch due, if more. The
-- grant expires by the end of the tally's window, so all its starts fall in the window it was
-- charged to; the statement moves the tally to the instant's window itself (as a claim under
-- the lock would, claim_count_tally.sql), and grants only while the tally counts whole windows
-- of W with the clock not behind it. When it deletes a grant charged to the tally's window, it
-- gives back what the grant left unused (grant_tally_back.sql; return_grant.sql does the
-- same). A grant deleted otherwise (by the trigger, or after its window) keeps its charge
-- until the window passes. The counts per partition, which claims under the lock read when the
-- tally cannot bound them (claim_key_started.sql), read the jobs of each claim on a grant from
-- its row of "{{table}}_claim_starts" and every grant's room left; this statement prunes those
-- rows once they leave the window.
--
-- It deletes the expired grants and the spent ones (no job or no claim left), and the
-- holder's grants in $6, so that their room comes back, whether it grants or not; a claim on
-- a grant it deletes finds no row and fails (claim_granted.sql). A grant moves the row's
-- claims counter, as a claim does: a claim under the lock whose snapshot predates it is stale
-- and claims again after the lock (claim_quota.sql).
WITH control AS MATERIALIZED (
    SELECT c.max_in_flight, c.max_per_partition,
           CASE WHEN c.rate_starts IS NOT NULL THEN c.rate_per_ms END AS rate_per_ms,
           c.rate_starts, c.rate_log,
           c.partition_rate_starts AS key_rate,
           CASE WHEN c.partition_rate_starts IS NOT NULL THEN c.partition_rate_per_ms END
               AS key_per_ms,
           c.partition_tally AS tally, c.partition_slots AS slots,
           -- The instant the grant counts by, once the lock is held (one for the statement).
           clock_timestamp() AS now_at
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1 AND c.paused_at IS NULL AND {{granting}}
),
swept AS (
    DELETE FROM "{{table}}_grants" AS g
    WHERE g.queue = $1
      AND (g.expires_at <= clock_timestamp() OR g.jobs_left = 0 OR g.claims_left = 0
           OR g.grant_id = ANY ($6::bigint[]))
    RETURNING {{swept_returning}}
),
granted AS MATERIALIZED (
    -- J and P of the snapshot's grants, less what the grants this statement deleted had left
    -- once deleted (their final values, swept's): what their claims took after the snapshot
    -- is in flight but not in the snapshot's rows, so it stays counted; what was left of them
    -- comes back at once.
    SELECT (SELECT COALESCE(sum(g.jobs_left), 0)
            FROM "{{table}}_grants" AS g WHERE g.queue = $1)::bigint
           - (SELECT COALESCE(sum(x.jobs_left), 0) FROM swept AS x)::bigint AS jobs,
           (SELECT COALESCE(sum(LEAST(g.per_claim::bigint * g.claims_left, g.jobs_left)), 0)
            FROM "{{table}}_grants" AS g WHERE g.queue = $1)::bigint
           - (SELECT COALESCE(sum(LEAST(x.per_claim::bigint * x.claims_left, x.jobs_left)), 0)
              FROM swept AS x)::bigint AS partition_room
),
logged AS MATERIALIZED (
    -- The rate's log within the window, the deleted grants' entries made final (grant_log.sql).
    SELECT CASE WHEN c.rate_per_ms IS NOT NULL THEN {{rewritten_log}} END AS log
    FROM control AS c
),
counts AS MATERIALIZED (
    -- (A CASE runs its subquery only when it is read: no count without its limit.)
    SELECT CASE WHEN c.max_in_flight IS NOT NULL THEN (
               SELECT count(*) FROM "{{table}}" AS j
               WHERE j.queue = $1 AND j.status = 'in_flight') END AS in_flight,
           CASE WHEN c.max_per_partition IS NOT NULL THEN (
               SELECT COALESCE(max(k.n), 0)
               FROM (SELECT count(*) AS n
                     FROM "{{table}}" AS j
                     WHERE j.queue = $1 AND j.status = 'in_flight'
                       AND j.partition_key IS NOT NULL
                     GROUP BY j.partition_key) AS k) END AS most,
           -- The starts in the rate's log, grants' entries (stamped ahead) included.
           CASE WHEN c.rate_per_ms IS NOT NULL THEN (
               SELECT COALESCE(sum((e ->> 1)::bigint), 0)::bigint
               FROM logged AS l CROSS JOIN LATERAL jsonb_array_elements(l.log) AS e) END
               AS started
    FROM control AS c
),
tallied AS MATERIALIZED (
    -- With a rate per partition: the queue's tally (claim_tally.sql) at the grant's instant,
    -- first given back what the grants this statement deletes did not use (those charged to
    -- the tally's own window: the window a grant was charged to ends at its expiry), then
    -- moved to the instant's window if the clock is past it; bound, what it leaves charged to
    -- the fullest slot (the most any partition may have started within the sliding window);
    -- ok, whether it counts whole windows of the rate's length with the clock not behind, so
    -- that a grant may be charged to it.
    SELECT t.per_ms, t.now_ms, t.bucket, t.ahead,
           COALESCE(t.per_ms IS NOT NULL
                    AND (c.tally ->> 'per_ms')::bigint = t.per_ms
                    AND (c.tally ->> 'since')::float8 <= t.now_ms - t.per_ms
                    AND t.ahead >= 0
                    AND (t.ahead >= 1 OR v.kept), false) AS ok,
           COALESCE((c.tally ->> 'per_ms')::bigint = t.per_ms, false) AS correctable,
           v.jobs, v.slots_jobs,
           CASE WHEN t.ahead = 1 THEN v.jobs ELSE (c.tally ->> 'before')::bigint END AS before,
           CASE WHEN t.ahead = 1 THEN CASE WHEN v.kept THEN v.top + v.untracked ELSE v.jobs END
                ELSE (c.tally ->> 'slot_before')::bigint END AS slot_before,
           CASE t.ahead WHEN 0 THEN (c.tally ->> 'slot_before')::bigint + v.untracked + v.top
                        WHEN 1 THEN CASE WHEN v.kept THEN v.top + v.untracked ELSE v.jobs END
                        ELSE 0 END AS bound,
           -- A claim's cap a slot: three times the batch's share of the slots (a batch of 500
           -- spread over many partitions picks about one of a slot; a cap of three holds back
           -- about ten jobs a claim, two about fifty), or half the most of one slot among the
           -- next batch due (a backlog of few partitions), whichever is more. Every claim of
           -- the grant is charged the cap in every slot, whatever it picks.
           GREATEST(1, ceil(3.0 * $3::bigint / {{slot_count}}),
                    -- (A CASE runs its subquery only when it is read.)
                    ceil(CASE WHEN c.key_per_ms IS NOT NULL THEN (SELECT count(*)::float8 / 2
                          FROM (SELECT {{due_slot}} AS slot
                                FROM (SELECT j.partition_key
                                      FROM "{{table}}" AS j
                                      WHERE j.queue = $1 AND j.status = 'pending'
                                        AND j.next_attempt_at <= now()
                                      ORDER BY j.next_attempt_at, j.priority, j.id
                                      LIMIT $3) AS j
                                WHERE j.partition_key IS NOT NULL) AS d
                          GROUP BY d.slot
                          ORDER BY 1 DESC
                          LIMIT 1) END))::bigint AS slot_cap,
           c.key_rate
    FROM control AS c
    CROSS JOIN LATERAL (
        SELECT c.key_per_ms AS per_ms, extract(epoch FROM c.now_at)::float8 * 1000 AS now_ms,
               floor(extract(epoch FROM c.now_at)::float8 * 1000 / c.key_per_ms)::bigint AS bucket,
               floor(extract(epoch FROM c.now_at)::float8 * 1000 / c.key_per_ms)::bigint
               - (c.tally ->> 'bucket')::bigint AS ahead
    ) AS t
    -- What the deleted grants charged to the tally's window and did not use.
    CROSS JOIN LATERAL (
{{tally_back}}
    ) AS b
    CROSS JOIN LATERAL (
        SELECT u.jobs, u.slots_jobs, u.jobs - u.slots_jobs AS untracked,
               COALESCE(cardinality(c.slots) = {{slot_count}}
                        AND (c.tally ->> 'slots_at')::bigint = (c.tally ->> 'bucket')::bigint
                        AND u.jobs - u.slots_jobs >= 0
                        AND jsonb_typeof(c.tally -> 'slot_before') = 'number', false) AS kept,
               (SELECT COALESCE(max(e), 0) FROM unnest(c.slots) AS e)::bigint AS top
        FROM (SELECT (c.tally ->> 'jobs')::bigint - b.jobs AS jobs,
                     (c.tally ->> 'slots_jobs')::bigint - b.jobs + b.slot_room AS slots_jobs)
             AS u
    ) AS v
),
claims AS MATERIALIZED (
    -- $4 claims, fewer when the share of max_per_partition's room is short of one job of a
    -- partition for each (a claim of one job a partition each, then).
    -- Under a rate per partition likewise, its share of what the fullest slot leaves short
    -- of the slot cap for each.
    SELECT LEAST(CASE WHEN c.max_per_partition IS NULL THEN $4::bigint
                      ELSE GREATEST(1, LEAST($4::bigint,
                                             (c.max_per_partition - n.most - g.partition_room)
                                             / {{grant_share}}))
                 END,
                 CASE WHEN t.per_ms IS NOT NULL
                      THEN GREATEST(1, LEAST($4::bigint, (t.key_rate - t.bound)
                                                         / ({{grant_share}} * t.slot_cap)))
                 END) AS k
    FROM control AS c, counts AS n, granted AS g, tallied AS t
),
sized AS MATERIALIZED (
    SELECT LEAST(k.k * $3::bigint,
                 (c.max_in_flight - n.in_flight - g.jobs) / {{grant_share}},
                 (c.rate_starts - n.started) / {{grant_share}}) AS jobs,
           k.k AS claims,
           -- Under a rate per partition the cap is a slot's, which caps its partitions too.
           LEAST(CASE WHEN c.max_per_partition IS NULL THEN LEAST($3::bigint, 2147483647)
                      ELSE LEAST($3::bigint,
                                 (c.max_per_partition - n.most - g.partition_room)
                                 / ({{grant_share}} * k.k))
                 END,
                 CASE WHEN t.per_ms IS NOT NULL
                      THEN LEAST(t.slot_cap, (t.key_rate - t.bound) / ({{grant_share}} * k.k))
                 END) AS per_claim
    FROM control AS c, counts AS n, granted AS g, claims AS k, tallied AS t
),
inserted AS (
    INSERT INTO "{{table}}_grants" (queue, holder, jobs_left, claims_left, per_claim, expires_at)
    SELECT $1, $2, s.jobs, s.claims::integer, s.per_claim,
           -- Under a rate per partition, no later than the end of the window it is charged to.
           LEAST(c.now_at + make_interval(secs => LEAST($5::bigint, c.rate_per_ms) / 1000.0),
                 CASE WHEN t.per_ms IS NOT NULL
                      THEN to_timestamp((t.bucket + 1) * t.per_ms / 1000.0) END)
    FROM sized AS s, control AS c, tallied AS t
    WHERE s.jobs >= $3::bigint AND s.per_claim >= 1 AND (t.per_ms IS NULL OR t.ok)
    RETURNING grant_id, jobs_left, claims_left, per_claim, expires_at
),
counted AS (
    -- A grant moves the claims counter; under a rate the log is written with the deleted
    -- grants' entries made final and the new grant's appended.
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + CASE WHEN EXISTS (SELECT 1 FROM inserted) THEN 1 ELSE 0 END,
        -- This release counts room grants (table migration 20261213000001, the fence).
        grants_counted = NOT c.grants_counted,
        -- Under a rate per partition: the tally given back what the deleted grants left
        -- unused, moved to the grant's window, and charged the new grant (its jobs to the
        -- sum, its claims' cap a slot to every slot as untracked jobs).
        partition_tally = CASE
            WHEN t.per_ms IS NULL OR NOT t.correctable THEN c.partition_tally
            ELSE c.partition_tally || (
                SELECT CASE WHEN t.ok AND t.ahead >= 1
                            THEN jsonb_build_object(
                                     'bucket', t.bucket, 'jobs', n.jobs,
                                     'before', CASE WHEN t.ahead = 1 THEN t.before ELSE 0 END,
                                     'slots_at', t.bucket, 'slots_jobs', n.jobs - n.slot_room,
                                     'slot_before',
                                     CASE WHEN t.ahead = 1 THEN t.slot_before ELSE 0 END)
                            ELSE jsonb_build_object(
                                     'jobs', t.jobs + n.jobs,
                                     'slots_jobs', t.slots_jobs + n.jobs - n.slot_room)
                       END || CASE WHEN n.jobs > 0 THEN jsonb_build_object('at', t.now_ms)
                                   ELSE '{}' END
                FROM (SELECT COALESCE(sum(i.jobs_left), 0)::bigint AS jobs,
                             COALESCE(sum(LEAST(i.per_claim::bigint * i.claims_left,
                                                i.jobs_left)), 0)::bigint AS slot_room
                      FROM inserted AS i) AS n)
            END,
        partition_slots = CASE
            WHEN t.per_ms IS NOT NULL AND t.ok AND t.ahead >= 1
            THEN array_fill(0, ARRAY[{{slot_count}}])
            ELSE c.partition_slots END,
        rate_log = CASE WHEN o.rate_per_ms IS NULL THEN c.rate_log ELSE
            (SELECT log FROM logged)
            || COALESCE((SELECT jsonb_agg(jsonb_build_array(
                                    extract(epoch FROM i.expires_at)::float8 * 1000,
                                    i.jobs_left, i.grant_id))
                         FROM inserted AS i), '[]')
        END
    FROM control AS o, tallied AS t
    WHERE c.queue = $1
      AND (EXISTS (SELECT 1 FROM inserted)
           OR ((o.rate_per_ms IS NOT NULL OR t.per_ms IS NOT NULL)
               AND EXISTS (SELECT 1 FROM swept)))
),
pruned AS (
    -- The rows of the claims on grants (claim_granted.sql) whose claim left the window count
    -- for no partition any more.
    DELETE FROM "{{table}}_claim_starts" AS s
    USING tallied AS t
    WHERE s.queue = $1 AND s.claim < 0 AND t.per_ms IS NOT NULL
      AND s.at_ms <= t.now_ms - t.per_ms
)
SELECT grant_id, jobs_left, claims_left, per_claim FROM inserted
