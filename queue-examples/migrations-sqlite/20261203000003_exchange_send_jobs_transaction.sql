-- Each send job belongs to one transaction: the hooks stamp the transaction its row names, never
-- the one its payload claims.
ALTER TABLE exchange_send_jobs ADD COLUMN transaction_id INTEGER REFERENCES exchange_transactions (id);
CREATE INDEX exchange_send_jobs_transaction_idx ON exchange_send_jobs (transaction_id);
