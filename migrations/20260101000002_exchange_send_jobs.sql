-- The send queue as it was before the claim lease (the seed's pre-#1185 shape): claimed by
-- flipping status to in_flight with no claim stamp, recovered by a boot-time sweep on the wrong
-- clock (next_attempt_at), finalized by bare id. Kept as history: the next migrations upgrade it.
CREATE TABLE exchange_send_jobs (
    id              bigserial   PRIMARY KEY,
    transaction_id  bigint      NOT NULL REFERENCES exchange_transactions (id),
    status          text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX idx_exchange_send_jobs_pending
    ON exchange_send_jobs (next_attempt_at) WHERE status = 'pending';
CREATE INDEX idx_exchange_send_jobs_stuck_in_flight
    ON exchange_send_jobs (next_attempt_at) WHERE status = 'in_flight';
