-- A claim's partitioned jobs, takeovers included, per slot of the tally of the rate per
-- partition (claim_slot.sql), all {{slot_count}} slots in order: what the claim adds to
-- partition_slots (claim_count_tally.sql) and, ahead of the queue's lock, what its slots must
-- fit (claim_ahead.sql). The body of a CTE after claimed, which claim_logged.sql and
-- claim_ahead.sql render; read only with a rate per partition (a CTE nobody reads never runs),
-- and computed once, before a claim ahead waits for the queue's row.
SELECT array_agg(COALESCE(k.jobs, 0) ORDER BY i) AS jobs
FROM generate_series(1, {{slot_count}}) AS i
LEFT JOIN (SELECT {{slot}} AS slot, count(*)::integer AS jobs
           FROM claimed AS cl
           WHERE cl.partition_key IS NOT NULL
           GROUP BY 1) AS k ON k.slot + 1 = i
