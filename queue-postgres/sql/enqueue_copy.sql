-- A bulk enqueue of jobs without unique keys: their rows in COPY's binary format, with the ids
-- enqueue_ids.sql drew and due times counted from its clock, in the same transaction (all
-- rows or none). The worker's wake-up is notify.sql, in the same transaction.
COPY "{{table}}" (id, queue, payload, priority, next_attempt_at, partition_key) FROM STDIN (FORMAT binary)
