-- Grants room to a queue handle for several claims (docs/adr/0004-room-grants.md): jobs it may
-- put in flight and claims it may make on them (claim_granted.sql), without the queue's row
-- lock, until the grant's row is deleted. Runs in the transaction of lock_queue.sql, after it,
-- so that its snapshot is younger than the lock and sees every claim and grant that held the
-- row before.
--
-- Parameters: $1 queue; $2 the holder's name (NULL for none); $3 the batch its claims ask for;
-- $4 how many claims at most; $5 the grant's life in milliseconds (the database's clock); $6 the
-- holder's grants spent to their end, returned here (deleted; empty for none). Returns the grant, or no
-- row when none is granted: the queue's switch is off, it has a rate or no limit in flight
-- (the grants leave the rates to claim_ahead.sql), it is paused, or the room its limits leave
-- is too short for a batch. Then claim under the lock.
--
-- The claims: $4, or fewer under max_per_partition when its share of the room is short of one
-- job of a partition for each of $4 (so that a queue with a low limit still gets grants).
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
-- only lower F: the snapshot's sums are never short.
--
-- It deletes the expired grants and the spent ones (no job or no claim left), and the
-- holder's grants in $6, so that their room comes back, whether it grants or not; a claim on
-- a grant it deletes finds no row and fails (claim_granted.sql). A grant moves the row's
-- claims counter, as a claim does: a claim under the lock whose snapshot predates it is stale
-- and claims again after the lock (claim_quota.sql).
WITH control AS MATERIALIZED (
    SELECT c.max_in_flight, c.max_per_partition
    FROM "{{table}}_queues" AS c
    WHERE c.queue = $1 AND c.paused_at IS NULL AND {{granting}}
),
granted AS MATERIALIZED (
    SELECT COALESCE(sum(g.jobs_left), 0)::bigint AS jobs,
           COALESCE(sum(LEAST(g.per_claim::bigint * g.claims_left, g.jobs_left)), 0)::bigint AS partition_room
    FROM "{{table}}_grants" AS g
    WHERE g.queue = $1
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
                     GROUP BY j.partition_key) AS k) END AS most
    FROM control AS c
),
claims AS MATERIALIZED (
    -- $4 claims, fewer when the share of max_per_partition's room is short of one job of a
    -- partition for each (a claim of one job a partition each, then).
    SELECT CASE WHEN c.max_per_partition IS NULL THEN $4::bigint
                ELSE GREATEST(1, LEAST($4::bigint,
                                       (c.max_per_partition - n.most - g.partition_room)
                                       / {{grant_share}}))
           END AS k
    FROM control AS c, counts AS n, granted AS g
),
sized AS MATERIALIZED (
    SELECT CASE WHEN c.max_in_flight IS NULL THEN k.k * $3::bigint
                ELSE LEAST(k.k * $3::bigint,
                           (c.max_in_flight - n.in_flight - g.jobs) / {{grant_share}})
           END AS jobs,
           k.k AS claims,
           CASE WHEN c.max_per_partition IS NULL THEN LEAST($3::bigint, 2147483647)
                ELSE LEAST($3::bigint,
                           (c.max_per_partition - n.most - g.partition_room)
                           / ({{grant_share}} * k.k))
           END AS per_claim
    FROM control AS c, counts AS n, granted AS g, claims AS k
),
swept AS (
    DELETE FROM "{{table}}_grants" AS g
    WHERE g.queue = $1
      AND (g.expires_at <= clock_timestamp() OR g.jobs_left = 0 OR g.claims_left = 0
           OR g.grant_id = ANY ($6::bigint[]))
),
inserted AS (
    INSERT INTO "{{table}}_grants" (queue, holder, jobs_left, claims_left, per_claim, expires_at)
    SELECT $1, $2, s.jobs, s.claims::integer, s.per_claim,
           clock_timestamp() + make_interval(secs => $5::bigint / 1000.0)
    FROM sized AS s
    WHERE s.jobs >= $3::bigint AND s.per_claim >= 1
    RETURNING grant_id, jobs_left, claims_left, per_claim
),
counted AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + 1
    WHERE c.queue = $1 AND EXISTS (SELECT 1 FROM inserted)
)
SELECT grant_id, jobs_left, claims_left, per_claim FROM inserted
