-- The queues of a table that have work or need attention: a pending or in-flight job, a
-- failed, dead or cancelled one, a pause, a worker that served it, or a stale fence. Each family is read by a skip scan over its partial
-- index ("{{table}}_due_idx", "{{table}}_expiry_idx", "{{table}}_failed_idx": queue is their
-- leading column), one index probe per queue, so the cost does not grow with the rows. A queue
-- whose jobs all completed is listed if a worker served it (served_at).
WITH RECURSIVE
pending(queue) AS (
    SELECT min(queue) FROM "{{table}}" WHERE status = 'pending'
    UNION ALL
    SELECT (SELECT min(queue) FROM "{{table}}" WHERE status = 'pending' AND queue > p.queue)
    FROM pending AS p WHERE p.queue IS NOT NULL
),
running(queue) AS (
    SELECT min(queue) FROM "{{table}}" WHERE status = 'in_flight'
    UNION ALL
    SELECT (SELECT min(queue) FROM "{{table}}" WHERE status = 'in_flight' AND queue > r.queue)
    FROM running AS r WHERE r.queue IS NOT NULL
),
ended(queue) AS (
    SELECT min(queue) FROM "{{table}}" WHERE status IN ('failed', 'dead', 'cancelled')
    UNION ALL
    SELECT (SELECT min(queue) FROM "{{table}}"
            WHERE status IN ('failed', 'dead', 'cancelled') AND queue > e.queue)
    FROM ended AS e WHERE e.queue IS NOT NULL
)
SELECT queue FROM pending WHERE queue IS NOT NULL
UNION SELECT queue FROM running WHERE queue IS NOT NULL
UNION SELECT queue FROM ended WHERE queue IS NOT NULL
UNION SELECT queue FROM "{{table}}_queues"
      WHERE paused_at IS NOT NULL OR served_at IS NOT NULL OR stale_fences > 0
UNION SELECT queue FROM "{{table}}_schedules"
ORDER BY queue
