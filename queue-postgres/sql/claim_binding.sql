-- Whether a limited claim's pick would put a partition over its room (claim_limited.sql renders
-- it as its CTE binding, after plain and quota; its lean form, for a queue without limits per
-- partition, renders the constant false instead). Parameters as claim.sql's.
    -- One hash aggregate over the picks and the queue's in-flight rows by key: a key binds when
    -- it has a pick and more rows than max_per_partition. The quota's held object
    -- (claim_turns.sql's) costs more to build; this form does not read it, so PostgreSQL never
    -- runs it. No key can have more rows than the picks and the queue's in-flight rows
    -- together: while those are within max_per_partition, the aggregate is not run. The
    -- in-flight rows are counted only as far as that needs (a walk of an in-flight index that
    -- stops after the limit's room left by the picks, plus one), rows without a key included
    -- so that no filter makes the walk read rows it does not count; past the limit the claim
    -- pays that walk on top of the aggregate. With a rate per partition, a key
    -- binds too when it has more picks than its claims within the window leave (one read of
    -- its log by primary key per picked key).
    SELECT ((SELECT per_partition FROM quota) IS NOT NULL
        AND (SELECT n.picks
                    + (SELECT count(*)
                       FROM (SELECT 1
                             FROM "{{table}}" AS j
                             WHERE j.queue = $1 AND j.status = 'in_flight'
                             LIMIT GREATEST(q.per_partition + 1 - n.picks, 0)) AS h)
                    > q.per_partition
             FROM quota AS q
             CROSS JOIN (SELECT count(*) AS picks
                         FROM plain AS p
                         WHERE p.partition_key IS NOT NULL) AS n)
        AND EXISTS (
        SELECT 1
        FROM (SELECT p.partition_key AS key, true AS pick
              FROM plain AS p
              WHERE p.partition_key IS NOT NULL AND (SELECT per_partition FROM quota) IS NOT NULL
              UNION ALL
              SELECT j.partition_key, false
              FROM "{{table}}" AS j
              WHERE j.queue = $1 AND j.status = 'in_flight' AND j.partition_key IS NOT NULL
                AND (SELECT per_partition FROM quota) IS NOT NULL) AS u
        GROUP BY u.key
        HAVING bool_or(u.pick) AND count(*) > (SELECT per_partition FROM quota)))
    OR EXISTS (
        SELECT 1
        FROM (SELECT p.partition_key AS key, count(*) AS picks
              FROM plain AS p
              WHERE p.partition_key IS NOT NULL AND (SELECT key_rate_starts FROM rated) IS NOT NULL
              GROUP BY p.partition_key) AS k
        WHERE k.picks > (SELECT key_rate_starts FROM rated) - {{key_started}}) AS binds

