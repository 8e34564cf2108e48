-- Claim statements still running in this database that started before $1: a drain waits for
-- them after its pause commits, because a claim that started earlier read the queue as running
-- and may still take jobs. Every claim statement's text starts with claim.sql's first line
-- ($2, so the match does not depend on the rest, which pg_stat_activity may cut).
--
-- Parameters: $1 an instant (the database's clock); $2 the claim statement's first line.
SELECT count(*) AS running
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
  AND query_start < $1 AND starts_with(query, $2)
