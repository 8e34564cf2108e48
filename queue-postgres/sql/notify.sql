-- A wake-up for jobs inserted by the adopter's own SQL, delivered when the surrounding
-- transaction commits.
--
-- Parameters: $1 channel; $2 queue (the payload workers filter on).
SELECT pg_notify($1, $2)
