-- One page of a queue's jobs, newest first: the admin API's listing.
--
-- Parameters: $1 queue; $2 the cursor (only ids below it; NULL for the first page); $3 how many
-- rows (the page and one more, which says there is a next page). {{statuses}} is the filter,
-- rendered from queue_core::JobStatus values only (never from input text): `AND status IN
-- ('dead')`, or nothing for every status.
--
-- Keyset on the primary key, never an offset: a page costs the same however deep it is. Failed,
-- dead and cancelled jobs are read through "{{table}}_failed_idx" (queue, status, id), which
-- holds nothing else; other listings walk the primary key backwards.
SELECT {{columns}}
FROM "{{table}}"
WHERE queue = $1 {{statuses}} AND ($2::bigint IS NULL OR id < $2)
ORDER BY id DESC
LIMIT $3
