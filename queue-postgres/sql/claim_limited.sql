-- The claim: recovery folded in, by the database's clock only.
-- This form claims from a queue with limits (its first line is claim.sql's, so that a drain
-- finds it running).
--
-- Parameters: claim.sql's $1 to $7 ($2 the batch the claimer asks for).
--
-- Guarantees: claim.sql's, and the queue's limits (queue_core::QueueLimits): at most
-- max_in_flight of the queue's jobs in flight once it commits (every in_flight row counts, its
-- lease expired or not: a holder may still renew a lease that has passed, and a takeover of an
-- expired one adds no job, so it is free), at most max_per_partition of one partition's jobs
-- in flight (counted the same way), at most rate_starts jobs claimed (takeovers included)
-- within any window of rate_per_ms milliseconds, and at most partition_rate_starts of one
-- partition's jobs claimed (takeovers included) within any window of partition_rate_per_ms, by
-- the database's clock at the moment of counting (clock_timestamp, after the lock). Claims of the queue take turns on its row
-- (control: FOR UPDATE, which returns the row as the last claim to hold it committed it).
-- Every claim that takes a job counts itself in the row's claims; when that count differs from
-- the one this statement's snapshot holds (seen), a claim committed after the snapshot was
-- taken, so the snapshot's counts are stale: the statement claims nothing (its picks take no
-- row) and returns a row marked 'stale' (try again; inside a transaction that took the lock
-- first, lock_queue.sql, it never is). rate_log holds the recent claims as [epoch
-- milliseconds, jobs] pairs (and room grants as [expiry, jobs, grant id], grant.sql); a claim
-- drops the ones older than the window and appends its own;
-- "{{table}}_starts" keeps such a log per partition (claim_logged.sql).
-- The in-flight counts read the queue's in-flight rows (an in-flight partial index). Finalizes the
-- snapshot does not see only make the counts higher. Assumes READ COMMITTED, as every statement
-- of the framework does.
--
-- Partitions: with a limit per partition, the pick is taken only when it puts no partition over
-- its room (max_per_partition, counting the partition's jobs already in flight; the rate per
-- partition, counting its claims within the window): binding. Otherwise the
-- statement takes nothing (no takeover either) and says so (a row marked 'turns'), and the
-- caller runs claim_turns.sql, where the partitions take turns and the takeovers are merged
-- with their offers in claim order (queue_core::partition says the rule). With a rate per
-- partition, whether the partitions are counted is decided once the pick is known (rated,
-- claim_rated.sql: not while the queue's tally, or its tally per slot of partition keys,
-- shows the pick cannot put a partition over its rate); when they are and claims made while
-- they were not must be folded into the partitions' logs first, the statement takes nothing
-- (no pick, no takeover) and returns a row marked 'fold'.
WITH {{claim_quota}},
plain AS MATERIALIZED (
{{claim_due}}
),
{{rated}},
binding AS MATERIALIZED (
{{binding}}
),
due AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, expired, partition_key
    FROM plain
    WHERE NOT (SELECT binds FROM binding) AND NOT (SELECT must_fold FROM rated)
),
{{claim_picks}},
next_cursor AS MATERIALIZED (
    SELECT cursor_key AS key FROM quota
),
{{claim_logged}}
