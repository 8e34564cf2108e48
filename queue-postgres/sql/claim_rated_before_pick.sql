-- How a claim of a queue with limits applies its rate per partition, decided before its pick
-- (claim_turns.sql and the lean form of claim_limited.sql render this as their CTE rated;
-- claim_rated.sql says what the columns mean): as claim_quota.sql decided it.
rated AS MATERIALIZED (
    SELECT key_rate_starts, key_rate_per_ms, unbound, must_fold FROM quota
)
