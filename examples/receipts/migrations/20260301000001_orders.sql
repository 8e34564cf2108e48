CREATE TABLE orders (
    id              bigserial   PRIMARY KEY,
    email           text        NOT NULL,
    receipt_sent_at timestamptz
);
