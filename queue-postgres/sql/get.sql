-- A job's row.
--
-- Parameters: $1 id; $2 queue. The columns are the table's column list (sql.rs, COLUMNS).
SELECT {{columns}} FROM "{{table}}" WHERE id = $1 AND queue = $2
