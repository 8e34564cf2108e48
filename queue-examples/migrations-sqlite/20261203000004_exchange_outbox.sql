-- Events for downstream consumers, staged in the same transaction as the send job's outcome,
-- only after its fenced write applied.
CREATE TABLE exchange_outbox (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    event_type       TEXT    NOT NULL CHECK (event_type IN ('exchange.sent', 'exchange.failed')),
    transaction_id   INTEGER NOT NULL REFERENCES exchange_transactions (id),
    correlation_id   TEXT    NOT NULL,
    send_job_id      INTEGER NOT NULL,
    claim_generation INTEGER NOT NULL,
    created_at       REAL    NOT NULL DEFAULT (unixepoch('subsec'))
) STRICT;
CREATE INDEX exchange_outbox_transaction_idx ON exchange_outbox (transaction_id);
CREATE INDEX exchange_outbox_correlation_idx ON exchange_outbox (correlation_id, event_type);
