-- Jobs per status in one queue. Scans the queue's rows: exact, and slow on large tables.
--
-- Parameters: $1 queue.
SELECT status, count(*) AS jobs FROM "{{table}}" WHERE queue = $1 GROUP BY status
