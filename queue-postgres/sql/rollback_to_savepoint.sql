-- Undoes everything since the latest savepoint.sql (a job whose hook failed), which stays set;
-- the transaction goes on, also after a failed statement. No parameters.
ROLLBACK TO SAVEPOINT queue_job
