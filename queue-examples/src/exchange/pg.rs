//! The exchange on PostgreSQL: the schema of the top-level `migrations/`, the send queue on the
//! upgraded legacy table `exchange_send_jobs`. Written once for both drivers (sqlx and
//! tokio-postgres): every statement runs through the queue's driver-neutral
//! [`PostgresTx::query`].

use std::sync::LazyLock;

use queue_core::{
    Backend, BackendTx, BoxError, FinalizeEvent, FinalizeHook, Hooks, Payload, ReopenEvent,
};
use queue_postgres::{Driver, PgQueueConfig, PostgresQueue, PostgresTx, Row, Sqlx, TableName};
use sqlx::PgPool;
use sqlx::migrate::Migrator;

use super::{
    EventType, EventView, ExchangeError, ExchangeStore, ExchangeSummary, FailureKind, QUEUE,
    RetryOutcome, SEND_JOBS_TABLE, SendPayload, TransactionStatus, TransactionView, events,
    guard_refused, queue_name,
};

/// The exchange's migrations (the service's own migrator, `_sqlx_migrations`), from the
/// workspace's `migrations/`: the pre-lease send-jobs table, then its lease upgrade.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| sqlx::migrate!("../migrations"));

/// Transactions and their send jobs, in one statement. `$1` partners, `$2` amounts, `$3` queue.
/// Each send job's partition is its partner: a limit per partition is a limit per partner.
const CREATE_TRANSACTIONS: &str = r#"
WITH t AS (
    INSERT INTO exchange_transactions (partner, amount_minor)
    SELECT * FROM unnest($1::text[], $2::bigint[])
    RETURNING id, correlation_id, partner, amount_minor
),
j AS (
    INSERT INTO exchange_send_jobs (transaction_id, queue, payload, partition_key)
    SELECT id, $3, jsonb_build_object('transaction_id', id, 'correlation_id', correlation_id,
                                      'partner', partner, 'amount_minor', amount_minor),
           partner
    FROM t
    RETURNING transaction_id
)
SELECT transaction_id FROM j ORDER BY transaction_id
"#;

/// The terminal guard: a terminal status never flips to another terminal one. `$1`
/// transaction, `$2` the status wanted.
const STAMP_GUARDED: &str = r#"
UPDATE exchange_transactions SET status = $2, updated_at = now()
WHERE id = $1 AND ($2 NOT IN ('success', 'failed') OR status NOT IN ('success', 'failed'))
"#;

/// Send jobs' outcomes on their transactions, for a batch of jobs in the finalize
/// transaction (one job is a batch of one): the transaction each job row belongs to (its own
/// `transaction_id` column) is stamped through the terminal guard, and the event is staged
/// only if this stamp applied. The status is the outcome's only when the payload named that
/// same transaction and its idempotency key; otherwise the transaction fails (what was sent,
/// if anything, was not its transmission). Two jobs of one transaction in one batch: one stamp
/// applies and the other is refused, as when they come one after the other. One array element
/// per job: `$1` send job, `$2` claim generation, `$3` the status the outcome leads to, `$4`
/// its event type, `$5` and `$6` the payload's transaction and key (NULL: none could be read).
/// Returns, per job that has a transaction, the transaction, whether the payload was its own
/// and whether it was stamped.
const SEND_OUTCOMES: &str = r#"
WITH input AS (
    SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::bigint[],
                         $6::text[])
        AS i(job_id, generation, status, event_type, named, key)
),
outcome AS (
    SELECT i.job_id, i.generation, j.transaction_id, own.payload AS own_payload,
           CASE WHEN own.payload THEN i.status ELSE 'failed' END AS status,
           CASE WHEN own.payload THEN i.event_type ELSE 'exchange.failed' END AS event_type
    FROM input AS i
    JOIN exchange_send_jobs AS j ON j.id = i.job_id
    LEFT JOIN exchange_transactions AS t ON t.id = j.transaction_id
    CROSS JOIN LATERAL (SELECT (j.transaction_id = i.named AND t.correlation_id = i.key)
                               IS TRUE AS payload) AS own
),
stamped AS (
    UPDATE exchange_transactions AS t SET status = outcome.status, updated_at = now()
    FROM outcome
    WHERE t.id = outcome.transaction_id AND t.status NOT IN ('success', 'failed')
    RETURNING t.id, t.correlation_id, outcome.event_type, outcome.job_id, outcome.generation
),
staged AS (
    INSERT INTO exchange_outbox (event_type, transaction_id, correlation_id, send_job_id,
                                 claim_generation)
    SELECT event_type, id, correlation_id, job_id, generation FROM stamped
    RETURNING send_job_id
)
SELECT outcome.job_id, outcome.transaction_id, outcome.own_payload,
       EXISTS (SELECT 1 FROM staged WHERE staged.send_job_id = outcome.job_id) AS stamped
FROM outcome JOIN exchange_transactions AS t ON t.id = outcome.transaction_id
"#;

/// Failed attempts' kinds on the transactions they sent, for a batch of jobs in the finalize
/// transaction: a key turns ambiguous if a failure under it was and stays so (see
/// [`FailureKind`]); several failures of one transaction in a batch count as one, ambiguous if
/// any was. Only while the transaction is open and only for its current key: a payload with
/// another key sent nothing under it. One array element per job: `$1` send job, `$2` the
/// failure's kind, `$3` the payload's key.
const RECORD_FAILURES: &str = r#"
WITH failure AS (
    SELECT j.transaction_id, i.key, bool_or(i.kind = 'ambiguous') AS ambiguous
    FROM unnest($1::bigint[], $2::text[], $3::text[]) AS i(job_id, kind, key)
    JOIN exchange_send_jobs AS j ON j.id = i.job_id
    GROUP BY j.transaction_id, i.key
)
UPDATE exchange_transactions AS t
SET send_failure = CASE WHEN f.ambiguous OR t.send_failure = 'ambiguous'
                        THEN 'ambiguous' ELSE 'definitive' END
FROM failure AS f
WHERE t.id = f.transaction_id AND t.correlation_id = f.key AND t.status = 'pending'
"#;

/// The transaction a send job's row belongs to. `$1` send job.
const TRANSACTION_OF_JOB: &str = r#"
SELECT t.id, t.correlation_id, t.partner, t.amount_minor, t.status, t.retries, t.send_failure
FROM exchange_send_jobs AS j JOIN exchange_transactions AS t ON t.id = j.transaction_id
WHERE j.id = $1
"#;

/// The guarded exit from `failed`: a new idempotency key only after a definitive failure; after
/// an ambiguous one, or none recorded, the key is kept (and stays ambiguous). `$1` transaction.
const REOPEN_FAILED: &str = r#"
UPDATE exchange_transactions
SET status = 'pending',
    correlation_id = CASE WHEN send_failure = 'definitive'
                          THEN gen_random_uuid()::text ELSE correlation_id END,
    send_failure = CASE WHEN send_failure = 'definitive' THEN NULL ELSE 'ambiguous' END,
    retries = retries + 1,
    updated_at = now()
WHERE id = $1 AND status = 'failed'
RETURNING id, correlation_id, partner, amount_minor, send_failure IS NOT NULL AS key_kept
"#;

/// A send job for a reopened transaction. `$1` transaction, `$2` queue.
const RESTAGE_SEND_JOB: &str = r#"
INSERT INTO exchange_send_jobs (transaction_id, queue, payload, partition_key)
SELECT id, $2, jsonb_build_object('transaction_id', id, 'correlation_id', correlation_id,
                                  'partner', partner, 'amount_minor', amount_minor),
       partner
FROM exchange_transactions WHERE id = $1
RETURNING id
"#;

/// The transaction of a send job, locked, its status, and whether the job is the
/// transaction's latest (an operator may reopen only that one: the others were superseded by a
/// retry). The lock comes first: a concurrent `retry_failed_transaction` (which restages a
/// send job under the same lock) finishes before "latest" is judged. `$1` job.
const REOPEN_TARGET: &str = r#"
WITH t AS (
    SELECT t.id, t.status FROM exchange_transactions AS t
    WHERE t.id = (SELECT transaction_id FROM exchange_send_jobs WHERE id = $1)
    FOR UPDATE
)
SELECT t.id, t.status,
       $1 = (SELECT max(id) FROM exchange_send_jobs WHERE transaction_id = t.id) AS latest
FROM t
"#;

/// A reopened send job carries its transaction's transmission again (its key may have been
/// repointed). `$1` job.
const REPAYLOAD_SEND_JOB: &str = r#"
UPDATE exchange_send_jobs AS j
SET payload = jsonb_build_object('transaction_id', t.id, 'correlation_id', t.correlation_id,
                                 'partner', t.partner, 'amount_minor', t.amount_minor)
FROM exchange_transactions AS t
WHERE j.id = $1 AND t.id = j.transaction_id
"#;

/// The send jobs of a transaction. `$1` transaction.
const SEND_JOBS: &str = r#"
SELECT id FROM exchange_send_jobs WHERE transaction_id = $1 ORDER BY id
"#;

const TRANSACTION: &str = r#"
SELECT id, correlation_id, partner, amount_minor, status, retries, send_failure
FROM exchange_transactions WHERE id = $1
"#;

const EVENTS: &str = r#"
SELECT event_type, transaction_id, correlation_id, send_job_id, claim_generation
FROM exchange_outbox WHERE transaction_id = $1 ORDER BY id
"#;

const SUMMARY: &str = r#"
SELECT
    (SELECT count(*) FROM exchange_transactions WHERE status = 'pending') AS pending,
    (SELECT count(*) FROM exchange_transactions WHERE status = 'success') AS success,
    (SELECT count(*) FROM exchange_transactions WHERE status = 'failed') AS failed,
    (SELECT count(*) FROM exchange_outbox WHERE event_type = 'exchange.sent') AS sent_events,
    (SELECT count(*) FROM exchange_outbox WHERE event_type = 'exchange.failed') AS failed_events,
    (SELECT count(DISTINCT s.correlation_id)
     FROM exchange_outbox AS s JOIN exchange_outbox AS f
       ON f.correlation_id = s.correlation_id AND f.id > s.id
     WHERE s.event_type = 'exchange.sent' AND f.event_type = 'exchange.failed')
        AS conflicting_events,
    (SELECT count(*) - count(DISTINCT send_job_id) FROM exchange_outbox)
    + (SELECT count(*) - count(DISTINCT correlation_id) FROM exchange_outbox
       WHERE event_type = 'exchange.sent') AS duplicate_events
"#;

/// What the guarded stamp did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StampOutcome {
    /// The status was written.
    Applied,
    /// The transaction was already terminal: nothing written.
    Refused,
}

/// The exchange on PostgreSQL, on either driver (sqlx by default).
pub struct PgExchange<D: Driver = Sqlx> {
    queue: PostgresQueue<D>,
}

impl<D: Driver> Clone for PgExchange<D> {
    fn clone(&self) -> Self {
        PgExchange {
            queue: self.queue.clone(),
        }
    }
}

impl<D: Driver> std::fmt::Debug for PgExchange<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgExchange")
            .field("queue", &self.queue)
            .finish()
    }
}

/// The send queue's configuration: the upgraded legacy table, the exchange's queue name.
pub fn send_queue_config() -> Result<PgQueueConfig, ExchangeError> {
    Ok(PgQueueConfig::new(
        TableName::new(SEND_JOBS_TABLE)?,
        queue_name(),
    ))
}

impl PgExchange<Sqlx> {
    /// Applies the exchange's migrations to `pool` and opens the send queue (checking its
    /// lease schema).
    pub async fn migrate_and_connect(pool: PgPool) -> Result<Self, ExchangeError> {
        MIGRATOR
            .run(&pool)
            .await
            .map_err(queue_postgres::PgError::from)?;
        Self::connect(pool).await
    }

    /// Opens the send queue; refuses a database whose send-jobs table lacks the lease schema.
    pub async fn connect(pool: PgPool) -> Result<Self, ExchangeError> {
        let queue = PostgresQueue::<Sqlx>::connect(pool, send_queue_config()?).await?;
        Ok(PgExchange { queue })
    }
}

impl<D: Driver> PgExchange<D> {
    /// The exchange on a send queue opened by the caller (any driver; its table must be the
    /// exchange's, see [`send_queue_config`]).
    pub fn from_queue(queue: PostgresQueue<D>) -> Self {
        PgExchange { queue }
    }

    /// The pool.
    pub fn pool(&self) -> &D::Pool {
        self.queue.pool()
    }

    /// Stamps a transaction's status through the terminal guard, in `tx`.
    pub async fn stamp_transaction(
        &self,
        tx: &mut PostgresTx<D>,
        transaction_id: i64,
        status: TransactionStatus,
    ) -> Result<StampOutcome, ExchangeError> {
        let rows = tx
            .execute(STAMP_GUARDED, (transaction_id, status.as_str()))
            .await?;
        Ok(if rows == 1 {
            StampOutcome::Applied
        } else {
            StampOutcome::Refused
        })
    }
}

/// The send job's outcome on the domain: stamps the transaction through the terminal guard and
/// stages `exchange.sent` / `exchange.failed`, in one statement, only when the stamp applied. A
/// refusal is logged, not an error: the job's fenced write is the source of truth. A payload
/// that names another transaction or key fails the job's own (logged as a mismatch).
struct SendOutcome;

/// The arrays of [`SEND_OUTCOMES`], one element per job.
#[derive(Default)]
struct Outcomes {
    jobs: Vec<i64>,
    generations: Vec<i64>,
    statuses: Vec<&'static str>,
    wanted: Vec<TransactionStatus>,
    event_types: Vec<&'static str>,
    named: Vec<Option<i64>>,
    keys: Vec<Option<String>>,
}

impl Outcomes {
    fn push(
        &mut self,
        job: &queue_core::ClaimedJob,
        status: TransactionStatus,
        event_type: EventType,
        named: Option<i64>,
        key: Option<String>,
    ) {
        self.jobs.push(job.id.0);
        self.generations.push(job.generation.0);
        self.statuses.push(status.as_str());
        self.wanted.push(status);
        self.event_types.push(event_type.as_str());
        self.named.push(named);
        self.keys.push(key);
    }
}

impl<D: Driver> FinalizeHook<PostgresTx<D>, SendPayload> for SendOutcome {
    fn name(&self) -> &str {
        "exchange.send_outcome"
    }

    async fn after_applied(
        &self,
        tx: &mut PostgresTx<D>,
        event: &FinalizeEvent<'_, SendPayload>,
    ) -> Result<(), BoxError> {
        SendOutcome::apply(tx, std::slice::from_ref(event)).await
    }

    async fn after_applied_batch(
        &self,
        tx: &mut PostgresTx<D>,
        events: &[FinalizeEvent<'_, SendPayload>],
    ) -> Result<(), BoxError>
    where
        PostgresTx<D>: Send,
        SendPayload: Sync,
    {
        SendOutcome::apply(tx, events).await
    }

    async fn after_reopened(
        &self,
        tx: &mut PostgresTx<D>,
        event: &ReopenEvent<'_, SendPayload>,
    ) -> Result<(), BoxError> {
        SendOutcome::reopen(tx, event.job.id.0).await
    }
}

/// The send queue's finalize hooks on PostgreSQL (either driver): what every finalize of a send
/// job and every operator's retry or cancel runs, so that the transaction and the outbox follow
/// the job. `exchange-admin` runs its commands with them.
pub fn send_hooks<D: Driver>() -> Hooks<PostgresTx<D>, SendPayload> {
    Hooks::new().with(SendOutcome)
}

impl SendOutcome {
    /// The outcomes of `events` on their transactions: failures recorded, then stamps and
    /// events staged, one statement each for the whole batch.
    async fn apply<D: Driver>(
        tx: &mut PostgresTx<D>,
        events: &[FinalizeEvent<'_, SendPayload>],
    ) -> Result<(), BoxError> {
        let payload = |event: &FinalizeEvent<'_, SendPayload>| match &event.payload {
            Payload::Parsed(payload) => (
                Some(payload.transaction_id),
                Some(payload.correlation_id.clone()),
            ),
            Payload::Malformed => (None, None),
        };
        let (mut failed, mut kinds, mut failed_keys) = (Vec::new(), Vec::new(), Vec::new());
        let mut outcomes = Outcomes::default();
        for event in events {
            let (named, key) = payload(event);
            if let (Some(kind), Some(key)) = (FailureKind::of_outcome(event.action), &key) {
                failed.push(event.job.id.0);
                kinds.push(kind.as_str());
                failed_keys.push(key.clone());
            }
            if let Some((event_type, status)) = EventType::for_outcome(event.action) {
                outcomes.push(event.job, status, event_type, named, key);
            }
        }
        if !failed.is_empty() {
            tx.execute(RECORD_FAILURES, (&failed, &kinds, &failed_keys))
                .await?;
        }
        if outcomes.jobs.is_empty() {
            return Ok(());
        }
        let params = (
            &outcomes.jobs,
            &outcomes.generations,
            &outcomes.statuses,
            &outcomes.event_types,
            &outcomes.named,
            &outcomes.keys,
        );
        let rows = tx.query(SEND_OUTCOMES, params).await?;
        let mut answered = std::collections::HashMap::with_capacity(rows.len());
        for row in &rows {
            let job: i64 = row.get("job_id")?;
            let own: i64 = row.get("transaction_id")?;
            answered.insert(
                job,
                (
                    own,
                    row.get::<bool>("own_payload")?,
                    row.get::<bool>("stamped")?,
                ),
            );
        }
        for (i, &job) in outcomes.jobs.iter().enumerate() {
            let Some(&(own, own_payload, stamped)) = answered.get(&job) else {
                return Err(format!("send job {job} has no transaction").into());
            };
            let status = outcomes.wanted[i];
            if outcomes.named[i].is_some() && !own_payload && status != TransactionStatus::Failed {
                events::payload_mismatch(job, own);
            }
            if !stamped {
                let wanted = if own_payload {
                    status
                } else {
                    TransactionStatus::Failed
                };
                guard_refused(own, wanted, job);
            }
        }
        Ok(())
    }

    /// An operator reopens a dead, failed or cancelled send job: its transaction follows by
    /// `retry_failed_transaction`'s rules (only a failed transaction, and only through its
    /// latest send job; the key kept after an ambiguous failure, repointed after a definitive
    /// one), and the job carries the transaction's transmission again.
    async fn reopen<D: Driver>(tx: &mut PostgresTx<D>, job: i64) -> Result<(), BoxError> {
        let rows = tx.query(REOPEN_TARGET, (job,)).await?;
        let Some(row) = rows.first() else {
            return Err(format!("send job {job} has no transaction").into());
        };
        let transaction: i64 = row.get("id")?;
        let status: String = row.get("status")?;
        if !row.get::<bool>("latest")? {
            return Err(format!(
                "send job {job} is not the latest of transaction {transaction}: retry that one"
            )
            .into());
        }
        if tx.query(REOPEN_FAILED, (transaction,)).await?.is_empty() {
            return Err(format!(
                "transaction {transaction} is {status}: only a failed transaction can be retried"
            )
            .into());
        }
        tx.execute(REPAYLOAD_SEND_JOB, (job,)).await?;
        Ok(())
    }
}

fn transaction_view<D: Driver>(row: &Row<D>) -> Result<TransactionView, ExchangeError> {
    let status: String = row.get("status")?;
    let send_failure: Option<String> = row.get("send_failure")?;
    let send_failure = send_failure
        .map(|kind| {
            FailureKind::parse(&kind)
                .ok_or_else(|| ExchangeError::Corrupt(format!("send failure {kind:?}")))
        })
        .transpose()?;
    Ok(TransactionView {
        id: row.get("id")?,
        correlation_id: row.get("correlation_id")?,
        partner: row.get("partner")?,
        amount_minor: row.get("amount_minor")?,
        status: TransactionStatus::parse(&status)
            .ok_or_else(|| ExchangeError::Corrupt(format!("transaction status {status:?}")))?,
        retries: row.get("retries")?,
        send_failure,
    })
}

fn event_view<D: Driver>(row: &Row<D>) -> Result<EventView, ExchangeError> {
    let event_type: String = row.get("event_type")?;
    Ok(EventView {
        event_type: match event_type.as_str() {
            "exchange.sent" => EventType::Sent,
            "exchange.failed" => EventType::Failed,
            other => return Err(ExchangeError::Corrupt(format!("event type {other:?}"))),
        },
        transaction_id: row.get("transaction_id")?,
        correlation_id: row.get("correlation_id")?,
        send_job_id: row.get("send_job_id")?,
        claim_generation: row.get("claim_generation")?,
    })
}

impl<D: Driver> ExchangeStore for PgExchange<D> {
    type Backend = PostgresQueue<D>;

    fn queue(&self) -> &PostgresQueue<D> {
        &self.queue
    }

    fn hooks(&self) -> Hooks<PostgresTx<D>, SendPayload> {
        send_hooks()
    }

    async fn transaction_of_job(
        &self,
        job_id: i64,
    ) -> Result<Option<TransactionView>, ExchangeError> {
        let rows = self.queue.query(TRANSACTION_OF_JOB, (job_id,)).await?;
        rows.first().map(transaction_view).transpose()
    }

    async fn send_jobs(&self, transaction_id: i64) -> Result<Vec<i64>, ExchangeError> {
        let rows = self.queue.query(SEND_JOBS, (transaction_id,)).await?;
        Ok(rows
            .iter()
            .map(|row| row.get("id"))
            .collect::<Result<_, _>>()?)
    }

    async fn create_transactions(
        &self,
        requests: &[(String, i64)],
    ) -> Result<Vec<i64>, ExchangeError> {
        let partners: Vec<&str> = requests.iter().map(|(p, _)| p.as_str()).collect();
        let amounts: Vec<i64> = requests.iter().map(|(_, a)| *a).collect();
        let mut tx = self.queue.begin().await?;
        let rows = tx
            .query(CREATE_TRANSACTIONS, (&partners, &amounts, QUEUE))
            .await?;
        let ids = rows
            .iter()
            .map(|row| row.get("transaction_id"))
            .collect::<Result<Vec<i64>, _>>()?;
        self.queue.notify_in(tx.conn()).await?;
        tx.commit().await?;
        Ok(ids)
    }

    async fn retry_failed_transaction(&self, id: i64) -> Result<RetryOutcome, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let reopened = tx.query(REOPEN_FAILED, (id,)).await?;
        let Some(row) = reopened.first() else {
            tx.rollback().await?;
            return Ok(match self.transaction(id).await? {
                None => RetryOutcome::NotFound,
                Some(view) => RetryOutcome::NotFailed(view.status),
            });
        };
        let correlation_id: String = row.get("correlation_id")?;
        let key_kept: bool = row.get("key_kept")?;
        let restaged = tx.query(RESTAGE_SEND_JOB, (id, QUEUE)).await?;
        let send_job_id: i64 = restaged
            .first()
            .ok_or_else(|| ExchangeError::Corrupt(format!("transaction {id} vanished")))?
            .get("id")?;
        self.queue.notify_in(tx.conn()).await?;
        tx.commit().await?;
        Ok(RetryOutcome::Retried {
            send_job_id,
            correlation_id,
            key_kept,
        })
    }

    async fn transaction(&self, id: i64) -> Result<Option<TransactionView>, ExchangeError> {
        let rows = self.queue.query(TRANSACTION, (id,)).await?;
        rows.first().map(transaction_view).transpose()
    }

    async fn events(&self, id: i64) -> Result<Vec<EventView>, ExchangeError> {
        let rows = self.queue.query(EVENTS, (id,)).await?;
        rows.iter().map(event_view).collect()
    }

    async fn summary(&self) -> Result<ExchangeSummary, ExchangeError> {
        let rows = self.queue.query(SUMMARY, ()).await?;
        let row = rows
            .first()
            .ok_or_else(|| ExchangeError::Corrupt("no summary row".into()))?;
        let n = |column: &str| -> Result<u64, ExchangeError> { Ok(row.get::<i64>(column)? as u64) };
        Ok(ExchangeSummary {
            pending: n("pending")?,
            success: n("success")?,
            failed: n("failed")?,
            sent_events: n("sent_events")?,
            failed_events: n("failed_events")?,
            conflicting_events: n("conflicting_events")?,
            duplicate_events: n("duplicate_events")?,
        })
    }
}
