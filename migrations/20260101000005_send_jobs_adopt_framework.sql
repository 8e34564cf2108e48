-- The exchange's own half of adopting the framework, after the generic lease upgrade:
-- * the legacy status word 'sent' becomes the framework's 'completed' (finished when last
--   updated, so retention reaches those rows);
-- * legacy rows get the payload the send handler reads (new rows are written with it);
-- * the legacy pending index is superseded by exchange_send_jobs_due_idx.
UPDATE exchange_send_jobs SET status = 'completed', finished_at = coalesce(finished_at, updated_at)
WHERE status = 'sent';

UPDATE exchange_send_jobs AS j
SET payload = jsonb_build_object(
        'transaction_id', t.id,
        'correlation_id', t.correlation_id,
        'partner', t.partner,
        'amount_minor', t.amount_minor)
FROM exchange_transactions AS t
WHERE t.id = j.transaction_id AND j.payload = '{}'::jsonb;

DROP INDEX IF EXISTS idx_exchange_send_jobs_pending;
