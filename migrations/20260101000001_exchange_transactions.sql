-- The exchange's transactions: one per partner transmission request. `correlation_id` is the
-- partner-side idempotency key; `retry_failed_transaction` repoints it when a failed transaction
-- is sent again.
CREATE TABLE exchange_transactions (
    id             bigserial   PRIMARY KEY,
    correlation_id text        NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
    partner        text        NOT NULL,
    amount_minor   bigint      NOT NULL,
    status         text        NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'success', 'failed')),
    retries        integer     NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
