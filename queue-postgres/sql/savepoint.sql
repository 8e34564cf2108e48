-- Sets a savepoint inside a transaction: the worker sets one before each job's fenced write and
-- hooks when it finalizes many jobs with hooks in one transaction. Savepoints nest under one
-- name; rollback_to_savepoint.sql returns to the latest. No parameters.
SAVEPOINT queue_job
