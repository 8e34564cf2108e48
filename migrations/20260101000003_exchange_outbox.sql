-- Events for downstream consumers, staged in the same transaction as the send job's outcome,
-- only after its fenced write applied.
CREATE TABLE exchange_outbox (
    id               bigserial   PRIMARY KEY,
    event_type       text        NOT NULL CHECK (event_type IN ('exchange.sent', 'exchange.failed')),
    transaction_id   bigint      NOT NULL REFERENCES exchange_transactions (id),
    correlation_id   text        NOT NULL,
    send_job_id      bigint      NOT NULL,
    claim_generation bigint      NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_exchange_outbox_transaction ON exchange_outbox (transaction_id);
