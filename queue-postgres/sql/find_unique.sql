-- The job of a queue that holds a unique key (through "{{table}}_unique_idx").
--
-- Parameters: $1 queue; $2 the key.
SELECT {{columns}} FROM "{{table}}" WHERE queue = $1 AND unique_key = $2
