-- The check of a claim taken ahead of the queue's row lock (claim.sql's picks with no limit
-- applied: sql::claim_checked), in its transaction, after lock_queue.sql, for a queue whose
-- limits are in flight only (max_in_flight, max_per_partition; no rate). This statement's
-- snapshot is younger than the lock, so it sees every claim that committed before the lock
-- came to this transaction, and this transaction's own jobs in flight: the counts are exact.
-- Claims of the queue that commit later take the lock after this transaction commits (every
-- claim of a limited queue checks or counts under the lock before it commits; claims on a
-- grant spend room the grants' rows hold, counted here), so no two pass on the same room.
--
-- Parameters: $1 queue, $2 the partition keys of the claim's jobs (the claim returns them:
-- reading them again by id was a fifth of the check).
--
-- Moves the row's claims counter (and flips grants_counted: this release counts room
-- grants, the fence of table migration 20261213000001), so that a claim under the lock whose
-- snapshot predates this one is stale, and a claim ahead (claim_ahead.sql) whose snapshot
-- predates it fails its check (counted_claims does not move with it). Returns over: whether
-- the queue's jobs in flight, plus the room its grants hold, pass max_in_flight, or a
-- partition of the claim's jobs has more in flight, plus the room a grant holds per partition,
-- than max_per_partition. Over, the caller rolls the transaction back: nothing it wrote stays.
WITH counted AS (
    UPDATE "{{table}}_queues" AS c
    SET claims = c.claims + 1,
        grants_counted = NOT c.grants_counted
    WHERE c.queue = $1
    RETURNING c.max_in_flight, c.max_per_partition
),
-- The sums as bigint: compared as numeric (what sum of bigint gives), the filter on every
-- partition's count cost a fifth of the check.
granted AS (
    SELECT COALESCE(sum(g.jobs_left), 0)::bigint AS jobs,
           COALESCE(sum(LEAST(g.per_claim::bigint * g.claims_left, g.jobs_left)), 0)::bigint
               AS per_partition
    FROM "{{table}}_grants" AS g
    WHERE g.queue = $1
),
keys AS MATERIALIZED (
    SELECT DISTINCT k.key COLLATE "C" AS key
    FROM unnest($2::text[]) AS k (key)
    WHERE k.key IS NOT NULL AND (SELECT max_per_partition FROM counted) IS NOT NULL
),
-- One read of the queue's in-flight rows (an in-flight partial index) counted by key, then
-- joined with the claim's keys: a filter by those keys inside let the planner read the
-- in-flight rows once per key (about 15 ms a claim instead of 2). The keys group and join
-- bytewise (COLLATE "C": equality is the same under every deterministic collation, and the
-- table's partition_key has the database's, which is deterministic; a column altered to a
-- nondeterministic collation would count here apart keys the other statements count as one):
-- the planner sorts the in-flight rows to group them, and a sort by the database's collation
-- was a third of the check. Only the partitions over the limit, the grants' room per
-- partition counted, are kept (HAVING): none, as a rule.
over_keys AS MATERIALIZED (
    SELECT j.partition_key COLLATE "C" AS key
    FROM "{{table}}" AS j
    WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL
      AND (SELECT max_per_partition FROM counted) IS NOT NULL
    GROUP BY 1
    HAVING count(*) + (SELECT per_partition FROM granted) > (SELECT max_per_partition FROM counted)
)
SELECT COALESCE(
           (SELECT max_in_flight FROM counted) IS NOT NULL
           AND (SELECT count(*) FROM "{{table}}" AS j
                WHERE j.queue = $1 AND j.status = 'in_flight')
               + (SELECT jobs FROM granted) > (SELECT max_in_flight FROM counted), false)
       OR EXISTS (SELECT 1 FROM over_keys AS h JOIN keys AS k ON k.key = h.key) AS over
