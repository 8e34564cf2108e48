//! Every statement the backend runs, once. Drivers and tests use these texts; nothing else
//! writes queue SQL.
//!
//! Templates name the table `"queue_jobs"`; [`Statements::new`] renders them for the configured
//! (validated) table. Every value is a bound parameter.

use std::sync::Arc;

use crate::ident::{TableName, render};

/// Enqueue one or many jobs in one statement.
///
/// Ids are drawn from the table's sequence before the insert so that every input row knows its
/// id whatever order `RETURNING` would use; a unique-key conflict inserts nothing and reports the
/// row as not inserted. When a channel is given, one `NOTIFY` is sent in the same transaction
/// (delivered on commit) if anything was inserted.
///
/// `$1` queue, `$2` quoted table name (for its sequence), `$3` payloads, `$4` priorities,
/// `$5` run-at instants (NULL: use `$6`), `$6` delays in seconds, `$7` unique keys, `$8` channel
/// (NULL: no notify).
pub const ENQUEUE: &str = r#"
WITH input AS MATERIALIZED (
    SELECT u.ord,
           nextval((SELECT pg_get_serial_sequence($2, 'id'))::regclass) AS id,
           u.payload, u.priority, u.run_at, u.delay_secs, u.unique_key
    FROM unnest($3::jsonb[], $4::int2[], $5::timestamptz[], $6::float8[], $7::text[])
         WITH ORDINALITY AS u(payload, priority, run_at, delay_secs, unique_key, ord)
),
inserted AS (
    INSERT INTO "queue_jobs" (id, queue, payload, priority, next_attempt_at, unique_key)
    SELECT id, $1, payload, priority,
           COALESCE(run_at, now() + make_interval(secs => COALESCE(delay_secs, 0))),
           unique_key
    FROM input
    ORDER BY ord
    ON CONFLICT (queue, unique_key) WHERE unique_key IS NOT NULL DO NOTHING
    RETURNING id
),
woken AS (
    SELECT pg_notify($8, $1)
    FROM (SELECT 1 FROM inserted LIMIT 1) AS any_inserted
    WHERE $8::text IS NOT NULL
)
SELECT input.id, inserted.id IS NOT NULL AS inserted, input.unique_key
FROM input
LEFT JOIN inserted ON inserted.id = input.id
LEFT JOIN woken ON true
ORDER BY input.ord
"#;

/// A wake-up for jobs inserted by the adopter's own SQL: `$1` channel, `$2` queue. Delivered
/// when the surrounding transaction commits.
pub const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// The ids of existing jobs holding unique keys (after an enqueue conflict).
/// `$1` queue, `$2` keys.
pub const LOOKUP_UNIQUE: &str = r#"
SELECT unique_key, id FROM "queue_jobs" WHERE queue = $1 AND unique_key = ANY($2::text[])
"#;

/// The claim: the seed's semantics (due pending jobs, or in-flight jobs whose lease expired,
/// a NULL `claimed_at` counting as expired; `next_attempt_at` order, then priority), with each
/// predicate as its own ordered, index-backed `FOR UPDATE SKIP LOCKED` pick so that its cost does
/// not grow with the backlog. PostgreSQL refuses `FOR UPDATE` under `UNION`, hence two
/// materialized CTEs merged afterwards. A takeover past the reclaim cap comes back flagged
/// `over_reclaim_cap` (its holder buries it through [`FINALIZE`], with the hooks).
///
/// `$1` queue, `$2` batch size, `$3` lease in seconds, `$4` reclaim cap. Rows come back in claim
/// order.
pub const CLAIM: &str = r#"
WITH due AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, false AS expired
    FROM "queue_jobs"
    WHERE queue = $1 AND status = 'pending' AND next_attempt_at <= now()
    ORDER BY next_attempt_at, priority, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
expired AS MATERIALIZED (
    SELECT id, next_attempt_at, priority, reclaims, true AS expired
    FROM "queue_jobs"
    WHERE queue = $1 AND status = 'in_flight'
      AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))
    ORDER BY claimed_at NULLS FIRST
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
picked AS (
    SELECT id, expired, reclaims
    FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS candidates
    ORDER BY next_attempt_at, priority, id
    LIMIT $2
),
claimed AS (
    UPDATE "queue_jobs" AS j
    SET status = 'in_flight',
        attempts = j.attempts + 1,
        reclaims = j.reclaims + CASE WHEN p.expired THEN 1 ELSE 0 END,
        claimed_at = now(),
        claim_generation = j.claim_generation + 1,
        updated_at = now()
    FROM picked AS p
    WHERE j.id = p.id
    RETURNING j.id, j.claim_generation, j.attempts, j.reclaims, j.claimed_at, j.priority,
              j.payload, j.next_attempt_at, p.expired AS taken_over,
              (p.expired AND p.reclaims >= $4) AS over_reclaim_cap
)
SELECT id, claim_generation, attempts, reclaims, claimed_at, priority, payload, taken_over,
       over_reclaim_cap
FROM claimed
ORDER BY next_attempt_at, priority, id
"#;

/// Every lease-holder write but the heartbeat, for one job or many: each row is a
/// compare-and-set on `(id, status = 'in_flight', claim_generation)`; the rows returned are the
/// writes that applied (the rest are `Stale`).
///
/// `$1` ids, `$2` generations, `$3` kinds (`Finalize::kind`), `$4` retry instants, `$5` retry
/// delays in seconds, `$6` errors.
pub const FINALIZE: &str = r#"
UPDATE "queue_jobs" AS j
SET status = CASE u.kind WHEN 'complete' THEN 'completed'
                         WHEN 'fail_terminal' THEN 'failed'
                         WHEN 'cancel' THEN 'cancelled'
                         WHEN 'bury' THEN 'dead'
                         ELSE 'pending' END,
    attempts = j.attempts - CASE WHEN u.kind = 'release' THEN 1 ELSE 0 END,
    next_attempt_at = CASE WHEN u.kind = 'retry'
                           THEN COALESCE(u.run_at, now() + make_interval(secs => COALESCE(u.delay_secs, 0)))
                           ELSE j.next_attempt_at END,
    last_error = CASE WHEN u.kind IN ('fail_terminal', 'retry', 'cancel', 'bury') THEN u.error
                      ELSE j.last_error END,
    updated_at = now(),
    finished_at = CASE WHEN u.kind IN ('complete', 'fail_terminal', 'cancel', 'bury') THEN now() END
FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::timestamptz[], $5::float8[], $6::text[])
     AS u(id, claim_generation, kind, run_at, delay_secs, error)
WHERE j.id = u.id AND j.status = 'in_flight' AND j.claim_generation = u.claim_generation
RETURNING j.id, u.claim_generation
"#;

/// The heartbeat: restamp the lease clock, fenced like a finalizer. `$1` id, `$2` generation.
pub const EXTEND_LEASE: &str = r#"
UPDATE "queue_jobs" SET claimed_at = now(), updated_at = now()
WHERE id = $1 AND status = 'in_flight' AND claim_generation = $2
"#;

/// Administrative cancel of a pending job. `$1` id, `$2` queue.
pub const CANCEL_PENDING: &str = r#"
UPDATE "queue_jobs" SET status = 'cancelled', updated_at = now(), finished_at = now()
WHERE id = $1 AND queue = $2 AND status = 'pending'
"#;

/// A job's status. `$1` id, `$2` queue.
pub const STATUS_OF: &str = r#"
SELECT status FROM "queue_jobs" WHERE id = $1 AND queue = $2
"#;

/// A job's row. `$1` id, `$2` queue.
pub const GET: &str = r#"
SELECT id, queue, status, payload, priority, attempts, reclaims, next_attempt_at, claimed_at,
       claim_generation, last_error, unique_key, created_at, updated_at, finished_at
FROM "queue_jobs" WHERE id = $1 AND queue = $2
"#;

/// Jobs per status. `$1` queue.
pub const COUNTS: &str = r#"
SELECT status, count(*) FROM "queue_jobs" WHERE queue = $1 GROUP BY status
"#;

/// One batch of the retention sweep: terminal rows finished longer ago than `$1` seconds, at
/// most `$2`, oldest first, skipping rows someone else holds. Covers every queue of the table.
pub const SWEEP_FINISHED: &str = r#"
WITH doomed AS (
    SELECT id FROM "queue_jobs"
    WHERE finished_at IS NOT NULL AND finished_at < now() - make_interval(secs => $1)
    ORDER BY finished_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
DELETE FROM "queue_jobs" AS j USING doomed WHERE j.id = doomed.id
"#;

/// The columns of a table: `$1` quoted table name (resolved on the search path).
pub const SCHEMA_COLUMNS: &str = r#"
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a
WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped
"#;

/// The indexes of a table, by name: `$1` quoted table name.
pub const SCHEMA_INDEXES: &str = r#"
SELECT c.relname::text
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass($1)
"#;

/// Whether the table's `id` draws from a sequence (serial or identity): `$1` quoted table name.
pub const SCHEMA_ID_SEQUENCE: &str = r#"
SELECT pg_get_serial_sequence($1, 'id') IS NOT NULL
"#;

/// The framework's migrations, `(version, text)`, in order: the same files `MIGRATOR` embeds
/// (a test checks that they agree), listed here so that drivers without sqlx's migrator can
/// render them for any table.
pub const TABLE_MIGRATIONS: [(i64, &str); 1] = [(
    20261130000001,
    include_str!("../migrations/20261130000001_queue_jobs.sql"),
)];

/// The legacy upgrade (the seed's D1, generalised).
pub const UPGRADE_LEGACY: &str = include_str!("../sql/upgrade_legacy.sql");

/// The statements of one table, rendered once.
#[derive(Debug, Clone)]
pub struct Statements {
    /// [`ENQUEUE`].
    pub enqueue: Arc<str>,
    /// [`LOOKUP_UNIQUE`].
    pub lookup_unique: Arc<str>,
    /// [`CLAIM`].
    pub claim: Arc<str>,
    /// [`FINALIZE`].
    pub finalize: Arc<str>,
    /// [`EXTEND_LEASE`].
    pub extend_lease: Arc<str>,
    /// [`CANCEL_PENDING`].
    pub cancel_pending: Arc<str>,
    /// [`STATUS_OF`].
    pub status_of: Arc<str>,
    /// [`GET`].
    pub get: Arc<str>,
    /// [`COUNTS`].
    pub counts: Arc<str>,
    /// [`SWEEP_FINISHED`].
    pub sweep_finished: Arc<str>,
}

impl Statements {
    /// Renders every statement for `table`.
    pub fn new(table: &TableName) -> Self {
        let r = |template: &str| -> Arc<str> { render(template, table).into() };
        Statements {
            enqueue: r(ENQUEUE),
            lookup_unique: r(LOOKUP_UNIQUE),
            claim: r(CLAIM),
            finalize: r(FINALIZE),
            extend_lease: r(EXTEND_LEASE),
            cancel_pending: r(CANCEL_PENDING),
            status_of: r(STATUS_OF),
            get: r(GET),
            counts: r(COUNTS),
            sweep_finished: r(SWEEP_FINISHED),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn squash(sql: &str) -> String {
        sql.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    /// Pins the properties the lease protocol rests on; a change here is a change of the
    /// protocol and needs the conformance suite extended, not this test edited away.
    #[test]
    fn claim_statement_keeps_the_lease_protocol() {
        let claim = squash(CLAIM);
        for needle in [
            "status = 'pending' AND next_attempt_at <= now()",
            "status = 'in_flight' AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $3))",
            "FOR UPDATE SKIP LOCKED",
            "claim_generation = j.claim_generation + 1",
            "attempts = j.attempts + 1",
            "claimed_at = now()",
            "due AS MATERIALIZED",
            "expired AS MATERIALIZED",
            "ORDER BY next_attempt_at, priority, id LIMIT $2",
        ] {
            assert!(claim.contains(needle), "claim lost {needle:?}");
        }
        assert_eq!(claim.matches("FOR UPDATE SKIP LOCKED").count(), 2);
        assert!(
            !claim.contains(" OR status"),
            "the two picks must stay separate"
        );
    }

    #[test]
    fn every_lease_holder_write_is_fenced_on_status_and_generation() {
        assert!(squash(FINALIZE).contains(
            "WHERE j.id = u.id AND j.status = 'in_flight' AND j.claim_generation = u.claim_generation"
        ));
        assert!(
            squash(EXTEND_LEASE)
                .contains("WHERE id = $1 AND status = 'in_flight' AND claim_generation = $2")
        );
    }

    #[test]
    fn finalize_kinds_match_the_core_names() {
        use queue_core::{Finalize, RunAt};
        let kinds = [
            Finalize::Complete,
            Finalize::FailTerminal {
                error: String::new(),
            },
            Finalize::RetryAt {
                at: RunAt::Now,
                error: String::new(),
            },
            Finalize::Release,
            Finalize::Cancel {
                reason: String::new(),
            },
            Finalize::Bury {
                reason: String::new(),
            },
        ];
        for kind in kinds {
            let quoted = format!("'{}'", kind.kind());
            assert!(
                FINALIZE.contains(&quoted),
                "FINALIZE does not know {quoted}"
            );
        }
    }

    #[test]
    fn rendering_touches_only_the_table() {
        let sql = Statements::new(&TableName::new("exchange_send_jobs").unwrap());
        assert!(sql.claim.contains("FROM \"exchange_send_jobs\""));
        assert!(!sql.claim.contains("queue_jobs"));
        assert!(!sql.enqueue.contains("\"queue_jobs"));
    }
}
