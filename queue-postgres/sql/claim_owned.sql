-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with a small max_per_partition on a grant that owns shards of
-- the partition keys (grant.sql; docs/adr/0004-room-grants.md, "Grants that own shards"),
-- without the queue's row lock (its first line is claim.sql's, so that a drain finds it
-- running).
--
-- Parameters: claim.sql's $1 to $7; $8 the grant; $9 how many due jobs to read in claim order
-- (the batch's worth of the grant's shards: the handle sizes it from their number).
--
-- While the grant's row lives, no other claim puts a pending job of an owned shard in flight:
-- the claims under the lock leave them out (claim_binding.sql, claim_walk_room.sql), no other
-- grant owns the shard, and a queue whose grants own shards has no grant of the other kind
-- (grant.sql). So this statement's snapshot counts those partitions' jobs in flight exactly,
-- but for claims on this same grant that commit after it: the spend is a compare-and-set on
-- the grant's claims_left as the snapshot read it (another claim on the grant that committed
-- since moved it, and this one fails), so every claim that spends the grant counted all the
-- jobs the grant's earlier claims put in flight. The grant's earlier owners' claims committed
-- before the row that gave the shard away was deleted (a delete waits for the row lock of the
-- spend, and a claim that finds its grant deleted fails whole), and the claims under the lock
-- that committed before the grant did before its snapshot began. Jobs finished or given back
-- since the snapshot only lower the counts.
--
-- It reads the due jobs in claim order ($9 of them, no lock), keeps those of owned shards and
-- those without a partition key, and picks the earliest of them, at most the batch and the
-- grant's jobs_left (queue_core::partition's rule within the grant's shards): when the pick
-- would put a partition over max_per_partition, counting its jobs in flight, it takes nothing
-- and says so (a row whose jobs_left is -1: the caller returns the grant, and the partitions
-- take turns under the lock; no takeover either). Otherwise it locks the picks again (SKIP LOCKED, still pending
-- and due) and takes them and the takeovers of lapsed leases, at most the grant's jobs_left in
-- all (a takeover puts no job in flight, but it starts one, which the queue's rate counts). The spend: jobs_left less its jobs,
-- claims_left less one, guarded as claim_granted.sql's is and by the compare-and-set; when it
-- fails, or the grant is gone, expired or spent in the snapshot, the statement fails with
-- SQLSTATE 22P02 and a message naming {{over}} (a cast of that text, made of the claim's job
-- count so that the planner cannot fold it into a constant), and nothing it wrote stays. A
-- claim that finds nothing due spends nothing.
WITH room AS MATERIALIZED (
    SELECT g.jobs_left, g.claims_left, g.per_claim, g.shards
    FROM "{{table}}_grants" AS g
    WHERE g.queue = $1 AND g.grant_id = $8 AND g.claims_left > 0 AND g.jobs_left > 0
      AND g.shards IS NOT NULL AND g.expires_at > clock_timestamp()
),
scanned AS MATERIALIZED (
    -- The due jobs in claim order, read without locks: the ordered scan of the due index,
    -- kept apart from the filter below so that the planner does not trade it for a scan of
    -- the whole backlog.
    SELECT s.id, s.next_attempt_at, s.priority, s.partition_key
    FROM (SELECT j.id, j.next_attempt_at, j.priority, j.partition_key
          FROM "{{table}}" AS j
          WHERE j.queue = $1 AND j.status = 'pending' AND j.next_attempt_at <= now()
            AND EXISTS (SELECT 1 FROM room)
            AND NOT EXISTS (SELECT 1 FROM "{{table}}_queues" AS c
                            WHERE c.queue = $1 AND c.paused_at IS NOT NULL)
          ORDER BY j.next_attempt_at, j.priority, j.id
          LIMIT $9) AS s
    WHERE s.partition_key IS NULL
       OR ((SELECT shards FROM room) >> {{shard_of_scanned}}) & 1 = 1
),
held AS MATERIALIZED (
    -- The jobs in flight of the owned shards' partitions, as this snapshot has them.
    SELECT j.partition_key AS key, count(*) AS n
    FROM "{{table}}" AS j
    WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL
      AND EXISTS (SELECT 1 FROM scanned)
      AND ((SELECT shards FROM room) >> {{shard_of_held}}) & 1 = 1
    GROUP BY j.partition_key
),
picks AS MATERIALIZED (
    -- The claim's pick: the earliest of those, as many as it may take.
    SELECT s.id, s.next_attempt_at, s.priority, s.partition_key
    FROM scanned AS s
    ORDER BY s.next_attempt_at, s.priority, s.id
    LIMIT LEAST($2::bigint, COALESCE((SELECT jobs_left FROM room), 0))
),
binding AS MATERIALIZED (
    -- Whether the pick would put a partition over max_per_partition (per_claim), counting its
    -- jobs in flight: then the partitions take turns, under the lock (claim_turns.sql).
    SELECT EXISTS (
        SELECT 1
        FROM (SELECT p.partition_key AS key, count(*) AS n
              FROM picks AS p
              WHERE p.partition_key IS NOT NULL
              GROUP BY p.partition_key) AS p
        LEFT JOIN held AS h ON h.key = p.key
        WHERE p.n + COALESCE(h.n, 0) > (SELECT per_claim FROM room)) AS binds
),
kept AS MATERIALIZED (
    SELECT p.id FROM picks AS p WHERE NOT (SELECT binds FROM binding)
),
due AS MATERIALIZED (
    -- The kept jobs locked, by id (the primary key's path), as they are now.
    SELECT j.id, j.next_attempt_at, j.priority, j.reclaims, false AS expired, j.partition_key
    FROM "{{table}}" AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM kept))
      AND j.queue = $1 AND j.status = 'pending' AND j.next_attempt_at <= now()
    FOR UPDATE SKIP LOCKED
),
{{claim_picks}},
spent AS (
    UPDATE "{{table}}_grants" AS g
    SET jobs_left = g.jobs_left - n.all_jobs,
        claims_left = g.claims_left - 1
    FROM (SELECT count(*) AS all_jobs FROM claimed) AS n
    WHERE g.queue = $1 AND g.grant_id = $8
      AND n.all_jobs > 0
      AND g.jobs_left >= n.all_jobs
      AND g.claims_left = (SELECT claims_left FROM room)
      AND g.expires_at > clock_timestamp()
    RETURNING g.jobs_left, g.claims_left
)
SELECT id, claim_generation, claim_token, attempts, reclaims, claimed_at, next_attempt_at AS due_at, priority,
       payload, taken_over, over_reclaim_cap, cancel_requested, NULL::bigint AS jobs_left,
       NULL::integer AS claims_left
FROM claimed
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, s.jobs_left,
       s.claims_left
FROM spent AS s
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, -1, NULL
WHERE (SELECT binds FROM binding)
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       ('{{over}} with ' || (SELECT count(*) FROM claimed) || ' jobs')::bigint, NULL
WHERE (EXISTS (SELECT 1 FROM claimed) AND NOT EXISTS (SELECT 1 FROM spent))
   OR NOT EXISTS (SELECT 1 FROM room)
ORDER BY due_at, priority, id
