//! The exchange send-job queue: partner transmissions, sent at least once, finalized exactly
//! once, with the transaction's status and the outbox events staged only after the job's fenced
//! write applied.
//!
//! * [`SendHandler`] sends one transmission through its partner's adapter, once it checked that
//!   the payload names the job's own transaction.
//! * [`ExchangeStore`] is the domain storage with two implementations, [`PgExchange`] (the
//!   `migrations/` schema, the pre-lease table upgraded) and [`MemExchange`] (in process).
//! * Each store provides one finalize hook, the send outcome: it stamps the job's transaction
//!   through the terminal guard (no success↔failed flip) and stages `exchange.sent` /
//!   `exchange.failed` only when that stamp applied, in the finalize transaction.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use queue_core::{
    Backend, CancelOutcome, Handler, Hooks, JobContext, JobError, Lease, QueueName, RetryPolicy,
    WorkerConfig,
};
use serde::{Deserialize, Serialize};

pub mod demo;
pub mod events;
mod http;
mod memory;
pub mod partner_server;
mod pg;
mod sqlite;

pub use http::{EndpointError, HttpPartner, PartnerConfigError, PartnerEndpoint, log_configured};
pub use memory::MemExchange;
pub use pg::{MIGRATOR, PgExchange, StampOutcome, send_hooks, send_queue_config};
pub use sqlite::{SQLITE_MIGRATOR, SqliteExchange, sqlite_send_hooks, sqlite_send_queue_config};

/// The queue name of send jobs.
pub const QUEUE: &str = "exchange.send";

/// The send-jobs table.
pub const SEND_JOBS_TABLE: &str = "exchange_send_jobs";

/// Every partner send is capped at 30 s unless its adapter says otherwise.
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// What the lease must leave beyond two full send timeouts: the finalize transaction and pool
/// waits. With the defaults: 2 × 30 s + 10 s = 70 s ≤ the 90 s lease.
pub const LEASE_MARGIN: Duration = Duration::from_secs(10);

/// The queue name as a value.
pub fn queue_name() -> QueueName {
    QueueName::new(QUEUE).expect("a valid queue name")
}

/// A send job's arguments (the `payload` column of `exchange_send_jobs`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendPayload {
    /// The transaction this transmission belongs to.
    pub transaction_id: i64,
    /// The partner-side idempotency key.
    pub correlation_id: String,
    /// The partner's name.
    pub partner: String,
    /// The amount, in minor units.
    pub amount_minor: i64,
}

/// A transaction's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransactionStatus {
    /// Waiting for its send job.
    Pending,
    /// The partner accepted the transmission.
    Success,
    /// The transmission failed for good.
    Failed,
}

impl TransactionStatus {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            TransactionStatus::Pending => "pending",
            TransactionStatus::Success => "success",
            TransactionStatus::Failed => "failed",
        }
    }

    /// Parses the stored text.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Pending, Self::Success, Self::Failed]
            .into_iter()
            .find(|status| status.as_str() == s)
    }

    /// Success and failed are terminal: only `retry_failed_transaction` leaves `failed`.
    pub fn is_terminal(self) -> bool {
        self != TransactionStatus::Pending
    }
}

/// An outbox event type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// `exchange.sent`.
    Sent,
    /// `exchange.failed`.
    Failed,
}

impl EventType {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Sent => "exchange.sent",
            EventType::Failed => "exchange.failed",
        }
    }

    /// The event and the transaction status a job outcome leads to; `None` for outcomes that do
    /// not end the transmission (retry, release).
    pub fn for_outcome(action: &queue_core::Finalize) -> Option<(EventType, TransactionStatus)> {
        use queue_core::Finalize;
        match action {
            Finalize::Complete => Some((EventType::Sent, TransactionStatus::Success)),
            Finalize::Fail { .. } | Finalize::Cancel { .. } | Finalize::Dead { .. } => {
                Some((EventType::Failed, TransactionStatus::Failed))
            }
            Finalize::Retry { .. } | Finalize::Release | Finalize::Snooze { .. } => None,
        }
    }
}

/// A transaction as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionView {
    /// Its id.
    pub id: i64,
    /// Its current idempotency key.
    pub correlation_id: String,
    /// Its partner.
    pub partner: String,
    /// The amount, in minor units.
    pub amount_minor: i64,
    /// Its status.
    pub status: TransactionStatus,
    /// How often `retry_failed_transaction` sent it again.
    pub retries: i32,
    /// What the failures under its current idempotency key leave known about the partner's
    /// side: `Ambiguous` once any of them was, `None` before the first failure.
    pub send_failure: Option<FailureKind>,
}

/// What a failed send leaves known about the partner's side of its idempotency key.
///
/// The order matters: once one failure under a key was ambiguous, the key stays ambiguous
/// (a later definitive answer, a 409 for a request still in progress say, does not prove the
/// earlier one was not acted on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FailureKind {
    /// The partner did not act on the key: it rejected it (a 4xx), or nothing reached it (the
    /// partner missing or unresolvable, a connection or TLS handshake refused, a payload
    /// refused before sending). `retry_failed_transaction` sends under a new key.
    Definitive,
    /// The partner may have acted on the key: a timeout, a connection lost after the request
    /// was written, a 5xx, a worker lost mid-send. `retry_failed_transaction` keeps the key so
    /// that the partner can deduplicate.
    Ambiguous,
}

impl FailureKind {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Definitive => "definitive",
            FailureKind::Ambiguous => "ambiguous",
        }
    }

    /// Parses the stored text.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Definitive, Self::Ambiguous]
            .into_iter()
            .find(|kind| kind.as_str() == s)
    }

    /// What a job outcome says about its attempt: `None` for outcomes that are not failures
    /// (complete, release). A handler error says it through [`ClassifiedFailure`]'s prefix in
    /// the stored error; any other failure (a job timeout, a worker lost past the reclaim cap,
    /// a cancel while sending) may have left a request with the partner: ambiguous.
    pub fn of_outcome(action: &queue_core::Finalize) -> Option<Self> {
        use queue_core::Finalize;
        match action {
            Finalize::Complete | Finalize::Release | Finalize::Snooze { .. } => None,
            Finalize::Fail { error } | Finalize::Retry { error, .. } => {
                Some(FailureKind::of_error(error))
            }
            // A pending job's cancel: nothing was being sent.
            Finalize::Cancel { reason } if reason == queue_core::CANCELLED_BY_OPERATOR => {
                Some(FailureKind::Definitive)
            }
            Finalize::Cancel { .. } | Finalize::Dead { .. } => Some(FailureKind::Ambiguous),
        }
    }

    /// The kind a stored error text names (see [`ClassifiedFailure`]); ambiguous unless it
    /// says definitive.
    pub fn of_error(error: &str) -> Self {
        let definitive = FailureKind::Definitive.as_str();
        match error.strip_prefix(definitive) {
            Some(rest) if rest.starts_with(": ") => FailureKind::Definitive,
            _ => FailureKind::Ambiguous,
        }
    }
}

/// A handler failure with its [`FailureKind`]: its text (the job's `last_error`) starts with
/// `definitive: ` or `ambiguous: `, which is how the send outcome hook learns it.
///
/// Its text already holds the failure's, so the failure is a field, not its `source()`: a chain
/// printed whole does not repeat it.
#[derive(Debug, thiserror::Error)]
#[error("{}: {error}", kind.as_str())]
pub struct ClassifiedFailure {
    /// What the failure leaves known.
    pub kind: FailureKind,
    /// The failure.
    pub error: queue_core::BoxError,
}

impl ClassifiedFailure {
    /// A failure after which the partner did not act on the key.
    pub fn definitive(source: impl Into<queue_core::BoxError>) -> Self {
        ClassifiedFailure {
            kind: FailureKind::Definitive,
            error: source.into(),
        }
    }
}

/// An outbox event as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventView {
    /// `exchange.sent` or `exchange.failed`.
    pub event_type: EventType,
    /// The transaction.
    pub transaction_id: i64,
    /// The idempotency key the transmission used.
    pub correlation_id: String,
    /// The send job whose outcome staged it.
    pub send_job_id: i64,
    /// The claim generation that applied that outcome.
    pub claim_generation: i64,
}

/// What `retry_failed_transaction` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetryOutcome {
    /// The transaction is pending again with a new send job: under its idempotency key after
    /// an ambiguous failure, under a new one after a definitive failure.
    Retried {
        /// The new send job.
        send_job_id: i64,
        /// The idempotency key the new send job uses.
        correlation_id: String,
        /// Whether that is the key of the failed sends (the failure was ambiguous, or not
        /// recorded).
        key_kept: bool,
    },
    /// Only a failed transaction can be retried.
    NotFailed(TransactionStatus),
    /// No such transaction.
    NotFound,
}

/// Totals over the whole exchange.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExchangeSummary {
    /// Transactions still pending.
    pub pending: u64,
    /// Transactions in success.
    pub success: u64,
    /// Transactions in failed.
    pub failed: u64,
    /// `exchange.sent` events.
    pub sent_events: u64,
    /// `exchange.failed` events.
    pub failed_events: u64,
    /// Idempotency keys with an `exchange.failed` event staged after an `exchange.sent` (a
    /// failed send retried under its kept key and then sent is not a conflict).
    pub conflicting_events: u64,
    /// Events beyond the first of a send job, plus `exchange.sent` events beyond the first of
    /// an idempotency key.
    pub duplicate_events: u64,
}

/// Errors of the exchange instance.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExchangeError {
    /// The lease leaves too little room for the slowest partner.
    #[error(
        "lease {lease:?} is below 2 × the largest partner send timeout ({largest:?}) + \
         {margin:?}: a send still in progress could be claimed and sent again"
    )]
    LeaseTooShort {
        /// The configured lease.
        lease: Duration,
        /// The largest send timeout.
        largest: Duration,
        /// The required margin.
        margin: Duration,
    },
    /// A queue error.
    #[error(transparent)]
    Queue(#[from] queue_core::Error),
    /// A database error.
    #[error(transparent)]
    Postgres(#[from] queue_postgres::PgError),
    /// A database error of the SQLite store.
    #[error(transparent)]
    Sqlite(#[from] queue_sqlite::SqliteError),
    /// Stored data outside the model.
    #[error("corrupt exchange data: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for ExchangeError {
    fn from(err: sqlx::Error) -> Self {
        ExchangeError::Postgres(err.into())
    }
}

/// Why a send did not go through. Texts never hold a partner URL's credentials.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// No answer within the adapter's send timeout (the partner may still have processed it).
    #[error("partner did not answer within {0:?}")]
    Timeout(Duration),
    /// The partner answered with a non-success status.
    #[error("partner answered HTTP {0}")]
    Status(u16),
    /// No connection (refused, unreachable, no such host): nothing reached the partner.
    #[error("connect: {0}")]
    Connect(String),
    /// The TLS handshake refused the partner (its certificate): nothing reached it, and no
    /// retry changes that.
    #[error("TLS refused: {0}")]
    Tls(String),
    /// The request could not be made (a malformed URL or body): nothing was sent.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The exchange broke after the request may have been written (a reset, a closed
    /// connection): the partner may have acted on it.
    #[error("transport: {0}")]
    Transport(String),
}

impl SendError {
    /// The handler's intent: client errors (4xx but 408 and 429), a refused TLS certificate and
    /// a request that cannot be made cannot be fixed by sending again; everything else is
    /// retried under the policy. The error carries its [`FailureKind`].
    pub fn into_job_error(self) -> JobError {
        let terminal = match &self {
            SendError::Status(code) => (400..500).contains(code) && *code != 408 && *code != 429,
            SendError::Tls(_) | SendError::Invalid(_) => true,
            SendError::Timeout(_) | SendError::Connect(_) | SendError::Transport(_) => false,
        };
        let failure = ClassifiedFailure {
            kind: self.failure_kind(),
            error: self.into(),
        };
        if terminal {
            JobError::fail(failure)
        } else {
            JobError::retry(failure)
        }
    }

    /// What this failure leaves known about the partner's side: a 4xx is the partner's answer,
    /// and nothing reached it without a connection; a timeout, a broken exchange and any other
    /// status (a 5xx) leave it unknown.
    pub fn failure_kind(&self) -> FailureKind {
        match self {
            SendError::Status(code) if (400..500).contains(code) => FailureKind::Definitive,
            SendError::Connect(_) | SendError::Tls(_) | SendError::Invalid(_) => {
                FailureKind::Definitive
            }
            SendError::Status(_) | SendError::Timeout(_) | SendError::Transport(_) => {
                FailureKind::Ambiguous
            }
        }
    }
}

/// One transmission as a partner adapter sees it.
#[derive(Debug, Clone, Copy)]
pub struct Transmission<'a> {
    /// The send job.
    pub job_id: i64,
    /// The claim generation of this attempt: a diagnostic header, never an idempotency key.
    pub generation: i64,
    /// The arguments.
    pub payload: &'a SendPayload,
}

/// A partner behind an adapter.
#[async_trait]
pub trait Partner: Send + Sync + 'static {
    /// The longest one send may take; the adapter enforces it.
    fn send_timeout(&self) -> Duration;
    /// Sends one transmission, with `payload.correlation_id` as its idempotency key.
    async fn send(&self, transmission: Transmission<'_>) -> Result<(), SendError>;
}

/// A partner registry entry.
#[derive(Clone)]
pub enum PartnerEntry {
    /// A partner that can be sent to.
    Active(Arc<dyn Partner>),
    /// A partner known by name whose endpoint cannot be resolved (not configured, withdrawn).
    Unresolvable(String),
}

/// The partners by name.
#[derive(Clone, Default)]
pub struct Partners {
    entries: HashMap<String, PartnerEntry>,
}

/// Why a partner could not be resolved: both end the transmission terminally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// No partner of that name.
    #[error("partner {0:?} is missing")]
    Missing(String),
    /// The partner exists but its endpoint cannot be resolved.
    #[error("partner {name:?} cannot be resolved: {reason}")]
    Unresolvable {
        /// The partner.
        name: String,
        /// Why.
        reason: String,
    },
}

impl Partners {
    /// No partners.
    pub fn new() -> Self {
        Partners::default()
    }

    /// Registers an active partner.
    pub fn with(mut self, name: impl Into<String>, partner: impl Partner) -> Self {
        self.entries
            .insert(name.into(), PartnerEntry::Active(Arc::new(partner)));
        self
    }

    /// Registers a partner whose endpoint cannot be resolved.
    pub fn with_unresolvable(mut self, name: impl Into<String>, reason: impl Into<String>) -> Self {
        self.entries
            .insert(name.into(), PartnerEntry::Unresolvable(reason.into()));
        self
    }

    /// The partner called `name`.
    pub fn resolve(&self, name: &str) -> Result<Arc<dyn Partner>, ResolveError> {
        match self.entries.get(name) {
            None => Err(ResolveError::Missing(name.to_owned())),
            Some(PartnerEntry::Unresolvable(reason)) => Err(ResolveError::Unresolvable {
                name: name.to_owned(),
                reason: reason.clone(),
            }),
            Some(PartnerEntry::Active(partner)) => Ok(partner.clone()),
        }
    }

    /// The largest send timeout of the active partners.
    pub fn largest_send_timeout(&self) -> Duration {
        self.entries
            .values()
            .filter_map(|entry| match entry {
                PartnerEntry::Active(partner) => Some(partner.send_timeout()),
                PartnerEntry::Unresolvable(_) => None,
            })
            .max()
            .unwrap_or(DEFAULT_SEND_TIMEOUT)
    }
}

/// Why a send job is not sent: its row and its payload disagree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// The job's row names no transaction.
    #[error("send job {job_id} belongs to no transaction")]
    NoTransaction {
        /// The send job.
        job_id: i64,
    },
    /// The payload is not the transmission of the job's own transaction: another
    /// transaction, another idempotency key, partner or amount (the payload's values are not
    /// repeated: payloads stay out of errors).
    #[error(
        "the payload of send job {job_id} is not the transmission of its own transaction ({own})"
    )]
    Mismatch {
        /// The send job.
        job_id: i64,
        /// The transaction the job's row belongs to.
        own: i64,
    },
}

impl SendPayload {
    /// Whether this is the transmission `transaction` stands for: its id, its current
    /// idempotency key, its partner and its amount.
    pub fn is_transmission_of(&self, transaction: &TransactionView) -> bool {
        self.transaction_id == transaction.id
            && self.correlation_id == transaction.correlation_id
            && self.partner == transaction.partner
            && self.amount_minor == transaction.amount_minor
    }
}

/// Sends one transmission per job.
///
/// The job's row, not its payload, says which transaction it sends: before sending, the handler
/// checks that the payload is that transaction's transmission (id, idempotency key, partner,
/// amount), and fails the job otherwise (the send outcome hook then fails the row's own
/// transaction, with its event), so that a tampered or mixed-up payload is never sent.
pub struct SendHandler<S> {
    store: S,
    partners: Arc<Partners>,
}

impl<S: Clone> Clone for SendHandler<S> {
    fn clone(&self) -> Self {
        SendHandler {
            store: self.store.clone(),
            partners: self.partners.clone(),
        }
    }
}

impl<S: ExchangeStore> SendHandler<S> {
    /// A handler over `partners`, checking payloads against `store`.
    pub fn new(store: S, partners: Partners) -> Self {
        SendHandler {
            store,
            partners: Arc::new(partners),
        }
    }

    /// Refuses a payload that is not the transmission of the job's own transaction.
    async fn check_payload(&self, job_id: i64, payload: &SendPayload) -> Result<(), JobError> {
        // The store could not answer: try again later, nothing was sent.
        let own = self
            .store
            .transaction_of_job(job_id)
            .await
            .map_err(|e| JobError::retry(ClassifiedFailure::definitive(e)))?;
        let refused = match own {
            None => PayloadError::NoTransaction { job_id },
            Some(own) if !payload.is_transmission_of(&own) => PayloadError::Mismatch {
                job_id,
                own: own.id,
            },
            Some(_) => return Ok(()),
        };
        events::payload_refused(&refused);
        Err(JobError::fail(ClassifiedFailure::definitive(refused)))
    }
}

impl<S: ExchangeStore> Handler for SendHandler<S> {
    type Payload = SendPayload;

    async fn handle(&self, ctx: JobContext, payload: SendPayload) -> Result<(), JobError> {
        self.check_payload(ctx.id().0, &payload).await?;
        // The two early terminal arms (partner missing, resolve miss): fail terminally through
        // the same fenced finalize as every other outcome, so the hooks stamp and stage.
        let partner = self
            .partners
            .resolve(&payload.partner)
            .map_err(|e| JobError::fail(ClassifiedFailure::definitive(e)))?;
        let timeout = partner.send_timeout();
        if ctx.lease_remaining() < timeout {
            // A send that could outlive the lease could race a second sender: do not start it.
            events::send_skipped_short_lease(ctx.id(), ctx.lease_remaining());
            return Err(JobError::release("too little lease left to send"));
        }
        let transmission = Transmission {
            job_id: ctx.id().0,
            generation: ctx.generation().0,
            payload: &payload,
        };
        partner
            .send(transmission)
            .await
            .map_err(SendError::into_job_error)
    }
}

/// How the exchange's workers run.
#[derive(Debug, Clone)]
pub struct ExchangeConfig {
    /// The claim lease (default 90 s).
    pub lease: Lease,
    /// Sends at once per worker (default 16).
    pub concurrency: usize,
    /// Sends per transmission before it fails terminally (default 5).
    pub max_attempts: u32,
    /// Backoff after the first failed send (default 1 s).
    pub retry_base: Duration,
    /// Poll interval when idle (default 1 s).
    pub poll_interval: Duration,
    /// What the lease must leave beyond two full send timeouts (default [`LEASE_MARGIN`]):
    /// the finalize transaction and pool waits. Lower it only where those are known to be
    /// short (the chaos suite's local runs).
    pub lease_margin: Duration,
    /// Write the outcomes many to a transaction, a savepoint per send (default true; see
    /// [`queue_core::WorkerConfig::batch_finalize`]); false writes each in a transaction of
    /// its own.
    pub batch_outcomes: bool,
}

impl Default for ExchangeConfig {
    fn default() -> Self {
        ExchangeConfig {
            lease: Lease::DEFAULT,
            concurrency: 16,
            max_attempts: 5,
            retry_base: Duration::from_secs(1),
            poll_interval: Duration::from_secs(1),
            lease_margin: LEASE_MARGIN,
            batch_outcomes: true,
        }
    }
}

impl ExchangeConfig {
    /// The worker configuration, refusing a lease below 2 × the largest send timeout + the
    /// margin.
    pub fn worker_config(&self, partners: &Partners) -> Result<WorkerConfig, ExchangeError> {
        let largest = partners.largest_send_timeout();
        if self.lease.duration() < largest * 2 + self.lease_margin {
            return Err(ExchangeError::LeaseTooShort {
                lease: self.lease.duration(),
                largest,
                margin: self.lease_margin,
            });
        }
        Ok(WorkerConfig {
            concurrency: self.concurrency,
            // A few claims ready to start; the handler refuses to send on too little lease.
            prefetch: self.concurrency / 2,
            poll_interval: self.poll_interval,
            lease: self.lease,
            // The adapter's own timeout fires first; this one catches a stuck adapter.
            job_timeout: largest + self.lease_margin / 2,
            retry: RetryPolicy {
                max_attempts: self.max_attempts,
                base_delay: self.retry_base,
                max_delay: (self.retry_base * 64).max(self.retry_base),
                jitter: true,
            },
            batch_finalize: self.batch_outcomes,
            ..WorkerConfig::default()
        })
    }
}

/// The exchange's storage: transactions, send jobs, outbox.
pub trait ExchangeStore: Clone + Send + Sync + 'static {
    /// The send queue's backend.
    type Backend: queue_core::Admin;

    /// The send queue.
    fn queue(&self) -> &Self::Backend;

    /// The finalize hooks: the send outcome (the transaction stamped through the terminal
    /// guard, and its event staged only if that stamp applied).
    fn hooks(&self) -> Hooks<<Self::Backend as Backend>::Tx, SendPayload>;

    /// The transaction a send job belongs to, as its row says (`None`: no such job, or a row
    /// without one).
    fn transaction_of_job(
        &self,
        job_id: i64,
    ) -> impl Future<Output = Result<Option<TransactionView>, ExchangeError>> + Send;

    /// The send jobs of a transaction, oldest first (one per send: the first, and one per
    /// [`ExchangeStore::retry_failed_transaction`]).
    fn send_jobs(
        &self,
        transaction_id: i64,
    ) -> impl Future<Output = Result<Vec<i64>, ExchangeError>> + Send;

    /// An operator's cancel of a send job, through the send outcome hook: a pending job is
    /// cancelled and its transaction fails with `exchange.failed`, in one transaction (so
    /// [`ExchangeStore::retry_failed_transaction`] can send it again); a job being sent is
    /// asked to stop, and its worker ends it the same way unless the send completes first.
    fn cancel_send_job(
        &self,
        job_id: i64,
    ) -> impl Future<Output = Result<CancelOutcome, ExchangeError>> + Send {
        async move {
            let hooks = self.hooks();
            Ok(
                queue_core::cancel_with_hooks(self.queue(), &hooks, queue_core::JobId(job_id))
                    .await?,
            )
        }
    }

    /// Creates transactions (partner, amount) with one send job each, in one transaction.
    /// Returns the transaction ids.
    fn create_transactions(
        &self,
        requests: &[(String, i64)],
    ) -> impl Future<Output = Result<Vec<i64>, ExchangeError>> + Send;

    /// The only legal exit from `failed`: back to pending with a new send job, in one
    /// transaction. After an ambiguous failure (or none recorded) the idempotency key is kept,
    /// so the partner can recognise a transmission it may already have acted on; after a
    /// definitive one it is repointed to a new key (docs/adr/0003).
    fn retry_failed_transaction(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<RetryOutcome, ExchangeError>> + Send;

    /// One transaction.
    fn transaction(
        &self,
        id: i64,
    ) -> impl Future<Output = Result<Option<TransactionView>, ExchangeError>> + Send;

    /// The outbox events of one transaction, oldest first.
    fn events(&self, id: i64)
    -> impl Future<Output = Result<Vec<EventView>, ExchangeError>> + Send;

    /// Totals.
    fn summary(&self) -> impl Future<Output = Result<ExchangeSummary, ExchangeError>> + Send;
}

pub(crate) use events::guard_refused;

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Duration);

    #[async_trait]
    impl Partner for Fixed {
        fn send_timeout(&self) -> Duration {
            self.0
        }
        async fn send(&self, _t: Transmission<'_>) -> Result<(), SendError> {
            Ok(())
        }
    }

    #[test]
    fn start_up_refuses_a_lease_too_short_for_the_slowest_partner() {
        let partners = Partners::new()
            .with("fast", Fixed(Duration::from_secs(5)))
            .with("slow", Fixed(Duration::from_secs(45)));
        let err = ExchangeConfig::default()
            .worker_config(&partners)
            .unwrap_err();
        assert!(
            matches!(err, ExchangeError::LeaseTooShort { largest, .. } if largest == Duration::from_secs(45))
        );
        assert!(
            err.to_string()
                .contains("2 × the largest partner send timeout")
        );
        let fine = Partners::new().with("fast", Fixed(DEFAULT_SEND_TIMEOUT));
        let config = ExchangeConfig::default().worker_config(&fine).unwrap();
        assert!(config.validate(false).is_ok());
    }

    #[test]
    fn client_errors_are_fatal_the_rest_retried() {
        use queue_core::ErrorAction;
        assert_eq!(
            SendError::Status(422).into_job_error().action(),
            ErrorAction::Fail
        );
        assert_eq!(
            SendError::Status(429).into_job_error().action(),
            ErrorAction::Retry
        );
        assert_eq!(
            SendError::Status(503).into_job_error().action(),
            ErrorAction::Retry
        );
        assert_eq!(
            SendError::Timeout(Duration::from_secs(1))
                .into_job_error()
                .action(),
            ErrorAction::Retry
        );
        assert_eq!(
            SendError::Tls("unknown issuer".into())
                .into_job_error()
                .action(),
            ErrorAction::Fail
        );
        assert_eq!(
            SendError::Connect("refused".into())
                .into_job_error()
                .action(),
            ErrorAction::Retry
        );
    }

    #[test]
    fn stored_errors_say_whether_the_partner_may_have_acted() {
        use queue_core::Finalize;
        let stored = |e: SendError| e.into_job_error().to_string();
        let fail = |error: String| Finalize::Fail { error };
        for (error, kind) in [
            (SendError::Status(422), FailureKind::Definitive),
            (
                SendError::Connect("refused".into()),
                FailureKind::Definitive,
            ),
            (
                SendError::Tls("unknown issuer".into()),
                FailureKind::Definitive,
            ),
            (SendError::Status(503), FailureKind::Ambiguous),
            (
                SendError::Timeout(Duration::from_secs(1)),
                FailureKind::Ambiguous,
            ),
            (SendError::Transport("reset".into()), FailureKind::Ambiguous),
        ] {
            let text = stored(error);
            assert_eq!(
                FailureKind::of_outcome(&fail(text.clone())),
                Some(kind),
                "{text}"
            );
            // The worker's give-up suffix keeps the prefix.
            let gave_up = format!("{text} (gave up after 3 failing runs)");
            assert_eq!(FailureKind::of_outcome(&fail(gave_up)), Some(kind));
        }
        // Unknown texts, a job timeout, a worker lost mid-send: the partner may have acted.
        assert_eq!(
            FailureKind::of_error("job timed out"),
            FailureKind::Ambiguous
        );
        assert_eq!(
            FailureKind::of_outcome(&Finalize::Dead {
                reason: "reclaimed".into()
            }),
            Some(FailureKind::Ambiguous)
        );
        assert_eq!(FailureKind::of_outcome(&Finalize::Complete), None);
    }

    #[test]
    fn resolve_distinguishes_missing_from_unresolvable() {
        let partners = Partners::new().with_unresolvable("umbrella", "endpoint withdrawn");
        assert_eq!(
            partners.resolve("initech").err(),
            Some(ResolveError::Missing("initech".into()))
        );
        assert!(matches!(
            partners.resolve("umbrella"),
            Err(ResolveError::Unresolvable { .. })
        ));
    }
}
