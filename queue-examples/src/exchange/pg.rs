//! The exchange on PostgreSQL: the schema of the top-level `migrations/`, the send queue on the
//! upgraded legacy table `exchange_send_jobs`.

use std::sync::LazyLock;

use async_trait::async_trait;
use queue_core::{BoxError, FinalizeEvent, FinalizeHook, Hooks};
use queue_postgres::{PgQueue, PgQueueConfig, PgTx, TableName};
use sqlx::migrate::Migrator;
use sqlx::postgres::PgConnection;
use sqlx::{PgPool, Row};

use super::{
    EventType, EventView, ExchangeError, ExchangeStore, ExchangeSummary, QUEUE, RetryOutcome,
    SEND_JOBS_TABLE, TransactionStatus, TransactionView, guard_refused, queue_name,
};

/// The exchange's migrations (the service's own migrator, `_sqlx_migrations`), from the
/// workspace's `migrations/`: the pre-lease send-jobs table, then its lease upgrade.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| sqlx::migrate!("../migrations"));

/// Transactions and their send jobs, in one statement. `$1` partners, `$2` amounts, `$3` queue.
const CREATE_TRANSACTIONS: &str = r#"
WITH t AS (
    INSERT INTO exchange_transactions (partner, amount_minor)
    SELECT * FROM unnest($1::text[], $2::bigint[])
    RETURNING id, correlation_id, partner, amount_minor
),
j AS (
    INSERT INTO exchange_send_jobs (transaction_id, queue, payload)
    SELECT id, $3, jsonb_build_object('transaction_id', id, 'correlation_id', correlation_id,
                                      'partner', partner, 'amount_minor', amount_minor)
    FROM t
    RETURNING transaction_id
)
SELECT transaction_id FROM j ORDER BY transaction_id
"#;

/// The terminal guard (the seed's D5): a terminal status never flips to another terminal one.
/// `$1` transaction, `$2` the status wanted.
const STAMP_GUARDED: &str = r#"
UPDATE exchange_transactions SET status = $2, updated_at = now()
WHERE id = $1 AND ($2 NOT IN ('success', 'failed') OR status NOT IN ('success', 'failed'))
"#;

/// Stages an event only if this very transaction's guard stamped the status the outcome leads
/// to (`updated_at = now()`: `now()` is the transaction's start, the same for both hooks), so a
/// guard that refused, even a same-status refusal, stops the event. `$1` transaction, `$2` event
/// type, `$3` job, `$4` generation, `$5` the status the outcome leads to.
const STAGE_EVENT: &str = r#"
INSERT INTO exchange_outbox (event_type, transaction_id, correlation_id, send_job_id, claim_generation)
SELECT $2, id, correlation_id, $3, $4 FROM exchange_transactions
WHERE id = $1 AND status = $5 AND updated_at = now()
"#;

/// The guarded exit from `failed` with a new idempotency key. `$1` transaction.
const REOPEN_FAILED: &str = r#"
UPDATE exchange_transactions
SET status = 'pending', correlation_id = gen_random_uuid()::text, retries = retries + 1,
    updated_at = now()
WHERE id = $1 AND status = 'failed'
RETURNING id, correlation_id, partner, amount_minor
"#;

/// A send job for a reopened transaction. `$1` transaction, `$2` queue.
const RESTAGE_SEND_JOB: &str = r#"
INSERT INTO exchange_send_jobs (transaction_id, queue, payload)
SELECT id, $2, jsonb_build_object('transaction_id', id, 'correlation_id', correlation_id,
                                  'partner', partner, 'amount_minor', amount_minor)
FROM exchange_transactions WHERE id = $1
RETURNING id
"#;

const TRANSACTION: &str = r#"
SELECT id, correlation_id, partner, amount_minor, status, retries FROM exchange_transactions WHERE id = $1
"#;

const EVENTS: &str = r#"
SELECT event_type, transaction_id, correlation_id, send_job_id, claim_generation
FROM exchange_outbox WHERE transaction_id = $1 ORDER BY id
"#;

const SUMMARY: &str = r#"
SELECT
    (SELECT count(*) FROM exchange_transactions WHERE status = 'pending'),
    (SELECT count(*) FROM exchange_transactions WHERE status = 'success'),
    (SELECT count(*) FROM exchange_transactions WHERE status = 'failed'),
    (SELECT count(*) FROM exchange_outbox WHERE event_type = 'exchange.sent'),
    (SELECT count(*) FROM exchange_outbox WHERE event_type = 'exchange.failed'),
    (SELECT count(*) FROM (SELECT correlation_id FROM exchange_outbox GROUP BY correlation_id
                           HAVING count(DISTINCT event_type) > 1) AS conflicting),
    (SELECT count(*) - count(DISTINCT (correlation_id, event_type)) FROM exchange_outbox)
"#;

/// What the guarded stamp did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampOutcome {
    /// The status was written.
    Applied,
    /// The transaction was already terminal: nothing written.
    Refused,
}

/// Stamps a transaction's status through the terminal guard, on the caller's connection.
pub async fn stamp_transaction(
    conn: &mut PgConnection,
    transaction_id: i64,
    status: TransactionStatus,
) -> Result<StampOutcome, sqlx::Error> {
    let done = sqlx::query(STAMP_GUARDED)
        .bind(transaction_id)
        .bind(status.as_str())
        .execute(conn)
        .await?;
    Ok(if done.rows_affected() == 1 {
        StampOutcome::Applied
    } else {
        StampOutcome::Refused
    })
}

/// The exchange on PostgreSQL.
#[derive(Clone, Debug)]
pub struct PgExchange {
    queue: PgQueue,
}

impl PgExchange {
    /// Applies the exchange's migrations to `pool` and opens the send queue (checking its
    /// lease schema).
    pub async fn migrate_and_connect(pool: PgPool) -> Result<PgExchange, ExchangeError> {
        MIGRATOR
            .run(&pool)
            .await
            .map_err(queue_postgres::PgError::from)?;
        Self::connect(pool).await
    }

    /// Opens the send queue; refuses a database whose send-jobs table lacks the lease schema.
    pub async fn connect(pool: PgPool) -> Result<PgExchange, ExchangeError> {
        let table = TableName::new(SEND_JOBS_TABLE)?;
        let queue = PgQueue::connect(pool, PgQueueConfig::new(table, queue_name())).await?;
        Ok(PgExchange { queue })
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        self.queue.pool()
    }
}

/// Stamps the transaction's status after the job's outcome applied; a refusal is logged, not an
/// error (the job's fenced write is the source of truth).
struct PgTerminalGuard;

#[async_trait]
impl FinalizeHook<PgQueue> for PgTerminalGuard {
    fn name(&self) -> &str {
        "exchange.terminal_guard"
    }

    async fn after_applied(
        &self,
        tx: &mut PgTx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        let Some((_, status)) = EventType::for_outcome(event.action) else {
            return Ok(());
        };
        let transaction_id = transaction_of(event)?;
        if stamp_transaction(tx, transaction_id, status).await? == StampOutcome::Refused {
            guard_refused(transaction_id, status, event.job.id.0);
        }
        Ok(())
    }
}

/// Stages `exchange.sent` / `exchange.failed` in the finalize transaction.
struct PgOutboxStager;

#[async_trait]
impl FinalizeHook<PgQueue> for PgOutboxStager {
    fn name(&self) -> &str {
        "exchange.outbox"
    }

    async fn after_applied(
        &self,
        tx: &mut PgTx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        let Some((event_type, status)) = EventType::for_outcome(event.action) else {
            return Ok(());
        };
        sqlx::query(STAGE_EVENT)
            .bind(transaction_of(event)?)
            .bind(event_type.as_str())
            .bind(event.job.id.0)
            .bind(event.job.generation.0)
            .bind(status.as_str())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

fn transaction_of(event: &FinalizeEvent<'_>) -> Result<i64, BoxError> {
    event.job.payload["transaction_id"]
        .as_i64()
        .ok_or_else(|| "send job payload has no transaction_id".into())
}

impl ExchangeStore for PgExchange {
    type Backend = PgQueue;

    fn queue(&self) -> &PgQueue {
        &self.queue
    }

    fn hooks(&self) -> Hooks<PgQueue> {
        Hooks::new().with(PgTerminalGuard).with(PgOutboxStager)
    }

    async fn create_transactions(
        &self,
        requests: &[(String, i64)],
    ) -> Result<Vec<i64>, ExchangeError> {
        let partners: Vec<&str> = requests.iter().map(|(p, _)| p.as_str()).collect();
        let amounts: Vec<i64> = requests.iter().map(|(_, a)| *a).collect();
        let mut tx = self.pool().begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(CREATE_TRANSACTIONS)
            .bind(&partners)
            .bind(&amounts)
            .bind(QUEUE)
            .fetch_all(&mut *tx)
            .await?;
        self.queue.notify_in(&mut tx).await?;
        tx.commit().await?;
        Ok(ids)
    }

    async fn retry_failed_transaction(&self, id: i64) -> Result<RetryOutcome, ExchangeError> {
        let mut tx = self.pool().begin().await?;
        let reopened = sqlx::query(REOPEN_FAILED)
            .bind(id)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(row) = reopened else {
            drop(tx);
            return Ok(match self.transaction(id).await? {
                None => RetryOutcome::NotFound,
                Some(view) => RetryOutcome::NotFailed(view.status),
            });
        };
        let correlation_id: String = row.try_get("correlation_id")?;
        let send_job_id: i64 = sqlx::query_scalar(RESTAGE_SEND_JOB)
            .bind(id)
            .bind(QUEUE)
            .fetch_one(&mut *tx)
            .await?;
        self.queue.notify_in(&mut tx).await?;
        tx.commit().await?;
        Ok(RetryOutcome::Retried {
            send_job_id,
            correlation_id,
        })
    }

    async fn transaction(&self, id: i64) -> Result<Option<TransactionView>, ExchangeError> {
        let row = sqlx::query(TRANSACTION)
            .bind(id)
            .fetch_optional(self.pool())
            .await?;
        row.map(|row| {
            let status: String = row.try_get("status")?;
            Ok(TransactionView {
                id: row.try_get("id")?,
                correlation_id: row.try_get("correlation_id")?,
                partner: row.try_get("partner")?,
                amount_minor: row.try_get("amount_minor")?,
                status: TransactionStatus::parse(&status).ok_or_else(|| {
                    ExchangeError::Corrupt(format!("transaction status {status:?}"))
                })?,
                retries: row.try_get("retries")?,
            })
        })
        .transpose()
    }

    async fn events(&self, id: i64) -> Result<Vec<EventView>, ExchangeError> {
        let rows = sqlx::query(EVENTS).bind(id).fetch_all(self.pool()).await?;
        rows.iter()
            .map(|row| {
                let event_type: String = row.try_get("event_type")?;
                Ok(EventView {
                    event_type: match event_type.as_str() {
                        "exchange.sent" => EventType::Sent,
                        "exchange.failed" => EventType::Failed,
                        other => {
                            return Err(ExchangeError::Corrupt(format!("event type {other:?}")));
                        }
                    },
                    transaction_id: row.try_get("transaction_id")?,
                    correlation_id: row.try_get("correlation_id")?,
                    send_job_id: row.try_get("send_job_id")?,
                    claim_generation: row.try_get("claim_generation")?,
                })
            })
            .collect()
    }

    async fn summary(&self) -> Result<ExchangeSummary, ExchangeError> {
        let row = sqlx::query(SUMMARY).fetch_one(self.pool()).await?;
        let n = |i: usize| -> Result<u64, sqlx::Error> { Ok(row.try_get::<i64, _>(i)? as u64) };
        Ok(ExchangeSummary {
            pending: n(0)?,
            success: n(1)?,
            failed: n(2)?,
            sent_events: n(3)?,
            failed_events: n(4)?,
            conflicting_events: n(5)?,
            duplicate_events: n(6)?,
        })
    }
}
