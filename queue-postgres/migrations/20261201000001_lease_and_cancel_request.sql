-- The lease is stored with the claim: lease_expires_at is set by the claim and by every
-- heartbeat, from the holder's own lease and the database's clock, and the claim takes over a
-- job in flight once it has passed, whatever the claimer's own lease. lease_generation is the
-- claim generation that expiry belongs to: a binary from before this migration claims and
-- renews without either, so when they disagree (or there is none) the claim counts the
-- claimer's lease from claimed_at, as before, and a row with neither counts as expired.
--
-- The index is the expired pick's: in-flight rows only, in expiry order, those without one first.
-- Building it scans the table once under a lock that blocks writes (not reads); on a large
-- table, build it beforehand with CREATE INDEX CONCURRENTLY under the same name.

-- cancel_requested_at is an operator's cancel of a job in flight, which only its holder may
-- end: the holder learns it at its next heartbeat or before it would give the job back, and a
-- claim that takes the job over returns it, so that the job is ended instead of run.

ALTER TABLE "{{table}}"
    ADD COLUMN IF NOT EXISTS lease_expires_at    timestamptz,
    ADD COLUMN IF NOT EXISTS lease_generation    bigint,
    ADD COLUMN IF NOT EXISTS cancel_requested_at timestamptz;

CREATE INDEX IF NOT EXISTS "{{table}}_expiry_idx"
    ON "{{table}}" (queue, lease_expires_at NULLS FIRST) WHERE status = 'in_flight';
