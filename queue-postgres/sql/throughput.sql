-- The jobs of a queue that ended in each of the last $2 minutes (the current one included), by
-- status, through "{{table}}_finished_idx": every row finished in the window is read, so the
-- cost grows with the queue's rate (about 60 ms for 500 000 jobs in the window). Minutes
-- without a finished job come back with zeros.
--
-- Parameters: $1 queue; $2 minutes (1 to 1440).
WITH minutes AS (
    SELECT generate_series(date_trunc('minute', now()) - make_interval(mins => $2 - 1),
                           date_trunc('minute', now()), interval '1 minute') AS minute
), ended AS (
    SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS jobs
    FROM "{{table}}"
    WHERE finished_at >= date_trunc('minute', now()) - make_interval(mins => $2 - 1)
      AND queue = $1
    GROUP BY 1, 2
)
SELECT m.minute,
       coalesce(sum(e.jobs) FILTER (WHERE e.status = 'completed'), 0)::bigint AS completed,
       coalesce(sum(e.jobs) FILTER (WHERE e.status = 'failed'), 0)::bigint AS failed,
       coalesce(sum(e.jobs) FILTER (WHERE e.status = 'dead'), 0)::bigint AS dead,
       coalesce(sum(e.jobs) FILTER (WHERE e.status = 'cancelled'), 0)::bigint AS cancelled
FROM minutes AS m LEFT JOIN ended AS e ON e.minute = m.minute
GROUP BY m.minute
ORDER BY m.minute
