-- Whether the partner may have acted on a transaction's current idempotency key: 'ambiguous'
-- once a send under it failed without a definitive answer (a timeout, a connection lost after
-- the request was written, a 5xx, a worker lost mid-send), 'definitive' when every failure was a
-- rejection (4xx) or never reached the partner, NULL before the first failure.
-- `retry_failed_transaction` keeps the key after an ambiguous failure (the partner can then
-- deduplicate) and repoints it only after a definitive one (docs/adr/0003).
ALTER TABLE exchange_transactions
    ADD COLUMN send_failure text CHECK (send_failure IN ('ambiguous', 'definitive'));

-- Transactions that failed before this column existed: what happened is unknown, so their key is
-- kept on retry, as after an ambiguous failure.
UPDATE exchange_transactions SET send_failure = 'ambiguous' WHERE status = 'failed';
