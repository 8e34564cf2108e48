-- The claim token: the half of the fence that a store which lost writes cannot repeat.
--
-- claim_generation counts claims, so a primary that never saw a claim (committed on an old
-- primary, lost in an asynchronous failover) counts to the same number again and hands it to a
-- second worker. claim_token is 64 random bits the claimer draws for each claim
-- (queue_core::ClaimToken) and every lease-holder write compares beside the generation, so the
-- first worker's writes are refused (Stale) although its generation matches. 0 marks a row no
-- claim of this version stamped. A constant default: adding the column rewrites no row.
ALTER TABLE "receipt_jobs"
    ADD COLUMN IF NOT EXISTS claim_token bigint NOT NULL DEFAULT 0;
