-- The exchange on SQLite: its transactions, one per partner transmission request. The same
-- model as the PostgreSQL schema in the workspace's `migrations/` (which also carries the legacy
-- table's history); SQLite starts on the lease schema. `correlation_id` is the partner-side
-- idempotency key, 128 random bits in hex; instants are SQLite's clock, REAL seconds.
CREATE TABLE exchange_transactions (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    correlation_id TEXT    NOT NULL UNIQUE DEFAULT (lower(hex(randomblob(16)))),
    partner        TEXT    NOT NULL,
    amount_minor   INTEGER NOT NULL,
    status         TEXT    NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'success', 'failed')),
    retries        INTEGER NOT NULL DEFAULT 0,
    -- Whether the partner may have acted on the current key (docs/adr/0003): 'ambiguous' once a
    -- send under it failed without a definitive answer, 'definitive' when every failure was a
    -- rejection or never reached the partner, NULL before the first failure.
    send_failure   TEXT    CHECK (send_failure IN ('ambiguous', 'definitive')),
    created_at     REAL    NOT NULL DEFAULT (unixepoch('subsec')),
    updated_at     REAL    NOT NULL DEFAULT (unixepoch('subsec'))
) STRICT;
