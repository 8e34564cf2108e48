-- A queue's health at a glance, each number read from an index so that the cost does not grow
-- with the table's history: backlog and lag from <table>_due_idx, leases from
-- <table>_expiry_idx (in-flight rows only: bounded by the workers' concurrency), the last
-- hour's outcomes from <table>_finished_idx. The due and scheduled counts stop at $4, so that a
-- large backlog costs no more than $4 index entries.
--
-- Parameters: $1 queue; $2 window in seconds (leases ending within it); $3 the lease, in
-- seconds, of rows claimed by a binary from before stored leases (as the claim judges them);
-- $4 the most the due and scheduled counts count.
SELECT
    (SELECT count(*) FROM (SELECT FROM "{{table}}"
     WHERE queue = $1 AND status = 'pending' AND next_attempt_at <= now() LIMIT $4) AS c) AS due,
    (SELECT count(*) FROM (SELECT FROM "{{table}}"
     WHERE queue = $1 AND status = 'pending' AND next_attempt_at > now() LIMIT $4) AS c)
        AS scheduled,
    (SELECT extract(epoch FROM now() - next_attempt_at)::float8 FROM "{{table}}"
     WHERE queue = $1 AND status = 'pending' AND next_attempt_at <= now()
     ORDER BY next_attempt_at LIMIT 1) AS oldest_due_wait_secs,
    lease.in_flight, lease.expired, lease.expiring,
    finished.completed, finished.failed, finished.dead, finished.cancelled
FROM (
    SELECT count(*) AS in_flight,
           count(*) FILTER (WHERE (lease_expires_at < now() OR lease_expires_at IS NULL)
                              AND (lease_generation = claim_generation OR claimed_at IS NULL
                                   OR claimed_at < now() - make_interval(secs => $3))) AS expired,
           count(*) FILTER (WHERE lease_expires_at >= now()
                              AND lease_expires_at < now() + make_interval(secs => $2)) AS expiring
    FROM "{{table}}"
    WHERE queue = $1 AND status = 'in_flight'
) AS lease, (
    SELECT count(*) FILTER (WHERE status = 'completed') AS completed,
           count(*) FILTER (WHERE status = 'failed') AS failed,
           count(*) FILTER (WHERE status = 'dead') AS dead,
           count(*) FILTER (WHERE status = 'cancelled') AS cancelled
    FROM "{{table}}"
    WHERE finished_at > now() - interval '1 hour' AND queue = $1
) AS finished
