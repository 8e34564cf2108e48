-- How a claim of a queue with a rate per partition applies it, once its pick is known
-- (claim_limited.sql renders this as its CTEs rated_slots and rated, after plain; claim_turns.sql
-- and the lean form, which decide before their picks, render claim_rated_before_pick.sql
-- instead). Columns of rated: key_rate_starts and key_rate_per_ms, the rate as the claim's
-- partitions are counted against it (NULL: no partition's log is read); unbound, whether the
-- claim can put no partition over its rate (then none is read and the claim's jobs are logged
-- in one row of "{{table}}_claim_starts"); must_fold, whether claims logged so must first be
-- folded into the partitions' logs (claim_logged.sql: the statement claims nothing and says
-- so).
--
-- Unbound when the queue's tally leaves room for the whole batch (quota.unbound), or when
-- its tally per slot (claim_quota.sql) leaves room in the slot of every picked job's partition
-- for that slot's picks and every takeover the claim could make: a takeover is a start too,
-- and the expired leases are not picked yet, so every slot, with picks or not, is charged all
-- of the queue's partitioned jobs whose lease has passed or was never set (at most the batch
-- each; two ranges of the expiry index). Parameters as claim.sql's.
rated_slots AS MATERIALIZED (
    -- Decided once (rated reads it four times).
    SELECT CASE WHEN q.unbound THEN true
           WHEN NOT q.slots_usable THEN false
           ELSE (SELECT NOT EXISTS (
                            SELECT 1
                            FROM (SELECT {{slot}} AS slot, count(*) AS picks
                                  FROM plain AS p
                                  WHERE p.partition_key IS NOT NULL
                                  GROUP BY 1) AS p
                            -- A count missing (slots_usable says none is) binds.
                            WHERE (q.slot_base + q.slot_counts[p.slot + 1]
                                   + p.picks + e.jobs > q.key_rate_starts) IS NOT FALSE)
                        -- A takeover may fall in a slot without picks: the fullest one.
                        AND (e.jobs = 0
                             OR q.slot_base + e.jobs + (
                                    SELECT COALESCE(max(n), 0)
                                    FROM unnest(q.slot_counts) AS n)
                                <= q.key_rate_starts)
                 -- Two ranges of the expiry index, not one walk of every lease in flight.
                 FROM (SELECT (SELECT count(*)
                               FROM (SELECT 1
                                     FROM "{{table}}" AS x
                                     WHERE x.queue = $1 AND x.status = 'in_flight'
                                       AND x.lease_expires_at < now()
                                       AND x.partition_key IS NOT NULL
                                     LIMIT $2) AS t)
                              + (SELECT count(*)
                                 FROM (SELECT 1
                                       FROM "{{table}}" AS x
                                       WHERE x.queue = $1 AND x.status = 'in_flight'
                                         AND x.lease_expires_at IS NULL
                                         AND x.partition_key IS NOT NULL
                                       LIMIT $2) AS t) AS jobs) AS e)
           END AS unbound
    FROM quota AS q
),
rated AS MATERIALIZED (
    SELECT CASE WHEN r.unbound THEN NULL ELSE q.key_rate_starts END AS key_rate_starts,
           CASE WHEN r.unbound THEN NULL ELSE q.key_rate_per_ms END AS key_rate_per_ms,
           r.unbound,
           NOT r.unbound AND q.tally_per_ms IS NOT NULL
               AND {{to_fold}}
               AS must_fold
    FROM quota AS q
    CROSS JOIN rated_slots AS r
)
