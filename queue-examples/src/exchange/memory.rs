//! The exchange in process memory, on the in-memory queue backend: for the demo without a
//! database and for unit tests. Domain writes happen inside the queue's transaction (which holds
//! the store's lock) and are taken back with `MemoryTx::on_rollback` if it rolls back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use queue_core::{
    Backend, BackendTx, BoxError, ClaimedJob, FinalizeEvent, FinalizeHook, Hooks, MemoryBackend,
    MemoryTx, NewJob, Payload, ReopenEvent,
};
use serde_json::Value;

use super::{
    EventType, EventView, ExchangeError, ExchangeStore, ExchangeSummary, FailureKind, RetryOutcome,
    SendPayload, TransactionStatus, TransactionView, events, guard_refused, queue_name,
};

#[derive(Default)]
struct Domain {
    next_id: i64,
    next_key: u64,
    transactions: BTreeMap<i64, TransactionView>,
    /// Each send job's transaction: the link a send-jobs table keeps in a column.
    jobs: HashMap<i64, i64>,
    outbox: Vec<EventView>,
}

impl Domain {
    fn new_key(&mut self) -> String {
        self.next_key += 1;
        format!("mem-{:016x}-{}", std::process::id(), self.next_key)
    }
}

/// The exchange in memory.
#[derive(Clone)]
pub struct MemExchange {
    queue: MemoryBackend,
    domain: Arc<Mutex<Domain>>,
}

impl Default for MemExchange {
    fn default() -> Self {
        MemExchange::new()
    }
}

impl MemExchange {
    /// An empty exchange.
    pub fn new() -> Self {
        MemExchange {
            queue: MemoryBackend::new().with_queue(queue_name()),
            domain: Arc::new(Mutex::new(Domain::default())),
        }
    }

    /// Sets a transaction's status through the terminal guard, inside `tx` (taken back if it
    /// rolls back). Returns whether it applied.
    pub fn stamp_transaction(&self, tx: &mut MemoryTx, id: i64, status: TransactionStatus) -> bool {
        let mut domain = self.domain.lock().unwrap();
        let Some(row) = domain.transactions.get_mut(&id) else {
            return false;
        };
        if status.is_terminal() && row.status.is_terminal() {
            return false;
        }
        let previous = row.status;
        row.status = status;
        let undo = self.domain.clone();
        tx.on_rollback(move || {
            if let Some(row) = undo.lock().unwrap().transactions.get_mut(&id) {
                row.status = previous;
            }
        });
        true
    }

    /// Records a failed attempt's kind on transaction `id` inside `tx` (taken back if it rolls
    /// back): only while it is open and only for its current key (`key`, the payload's); once
    /// ambiguous, the key stays so.
    fn record_failure(&self, tx: &mut MemoryTx, id: i64, key: &str, kind: FailureKind) {
        let mut domain = self.domain.lock().unwrap();
        let Some(row) = domain.transactions.get_mut(&id) else {
            return;
        };
        if row.status != TransactionStatus::Pending || row.correlation_id != key {
            return;
        }
        let previous = row.send_failure;
        row.send_failure = Some(previous.map_or(kind, |old| old.max(kind)));
        let undo = self.domain.clone();
        tx.on_rollback(move || {
            if let Some(row) = undo.lock().unwrap().transactions.get_mut(&id) {
                row.send_failure = previous;
            }
        });
    }

    /// Stages an event for transaction `id` inside `tx` (taken back if it rolls back).
    fn stage(&self, tx: &mut MemoryTx, id: i64, event_type: EventType, job: &ClaimedJob) {
        let mut domain = self.domain.lock().unwrap();
        let Some(row) = domain.transactions.get(&id) else {
            return;
        };
        let staged = EventView {
            event_type,
            transaction_id: id,
            correlation_id: row.correlation_id.clone(),
            send_job_id: job.id.0,
            claim_generation: job.generation.0,
        };
        domain.outbox.push(staged);
        let undo = self.domain.clone();
        tx.on_rollback(move || {
            undo.lock().unwrap().outbox.pop();
        });
    }

    /// Enqueues the send job of `view` inside `tx` and links it to its transaction.
    async fn enqueue_send(
        &self,
        tx: &mut MemoryTx,
        view: &TransactionView,
    ) -> Result<i64, ExchangeError> {
        let job = NewJob::new(&transmission(view))?.partition_key(view.partner.clone());
        self.enqueue_linked(tx, view.id, job).await
    }

    /// Enqueues `job` inside `tx` as the send job of transaction `id`.
    async fn enqueue_linked(
        &self,
        tx: &mut MemoryTx,
        id: i64,
        job: NewJob,
    ) -> Result<i64, ExchangeError> {
        let job = self.queue.enqueue_in(tx, job).await?.id.0;
        self.domain.lock().unwrap().jobs.insert(job, id);
        let undo = self.domain.clone();
        tx.on_rollback(move || {
            undo.lock().unwrap().jobs.remove(&job);
        });
        Ok(job)
    }
}

impl MemExchange {
    /// Creates a transaction inside `tx` (taken back if it rolls back).
    fn new_transaction(
        &self,
        tx: &mut MemoryTx,
        partner: &str,
        amount_minor: i64,
    ) -> TransactionView {
        let view = {
            let mut domain = self.domain.lock().unwrap();
            domain.next_id += 1;
            let view = TransactionView {
                id: domain.next_id,
                correlation_id: domain.new_key(),
                partner: partner.to_owned(),
                amount_minor,
                status: TransactionStatus::Pending,
                retries: 0,
                send_failure: None,
            };
            domain.transactions.insert(view.id, view.clone());
            view
        };
        let undo = self.domain.clone();
        let id = view.id;
        tx.on_rollback(move || {
            undo.lock().unwrap().transactions.remove(&id);
        });
        view
    }

    /// Creates a transaction whose send job carries the payload `payload` makes of it, not the
    /// transaction's own: how tests bring in the hostile payloads a table can hold (`{}`,
    /// `null`, another transaction's, its own with another key). Returns the transaction's id.
    pub async fn create_with_payload(
        &self,
        partner: &str,
        amount_minor: i64,
        payload: impl FnOnce(&TransactionView) -> Value,
    ) -> Result<i64, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let view = self.new_transaction(&mut tx, partner, amount_minor);
        self.enqueue_linked(&mut tx, view.id, NewJob::from_value(payload(&view)))
            .await?;
        tx.commit().await?;
        Ok(view.id)
    }
}

/// The transmission a send job of `view` carries.
fn transmission(view: &TransactionView) -> SendPayload {
    SendPayload {
        transaction_id: view.id,
        correlation_id: view.correlation_id.clone(),
        partner: view.partner.clone(),
        amount_minor: view.amount_minor,
    }
}

impl MemExchange {
    /// The only legal exit from `failed`, inside `tx` (undone on rollback): back to pending, the
    /// key kept after an ambiguous failure and repointed after a definitive one. `Err(None)`:
    /// no such transaction; `Err(Some(status))`: it is not failed.
    fn reopen_transaction(
        &self,
        tx: &mut MemoryTx,
        id: i64,
    ) -> Result<TransactionView, Option<TransactionStatus>> {
        let mut domain = self.domain.lock().unwrap();
        let key = domain.new_key();
        let row = domain.transactions.get_mut(&id).ok_or(None)?;
        if row.status != TransactionStatus::Failed {
            return Err(Some(row.status));
        }
        let previous = row.clone();
        row.status = TransactionStatus::Pending;
        // A new key only after a definitive failure: after an ambiguous one (or none
        // recorded) the partner may have acted on the key, and must be able to recognise it.
        if row.send_failure == Some(FailureKind::Definitive) {
            row.correlation_id = key;
            row.send_failure = None;
        } else {
            row.send_failure = Some(FailureKind::Ambiguous);
        }
        row.retries += 1;
        let view = row.clone();
        let undo = self.domain.clone();
        tx.on_rollback(move || {
            undo.lock().unwrap().transactions.insert(id, previous);
        });
        Ok(view)
    }
}

/// The send job's outcome on the domain: stamps the job's transaction through the terminal
/// guard and stages the event only when the stamp applied, in the queue's transaction. A
/// payload that names another transaction fails the job's own (logged as a mismatch).
struct SendOutcome(MemExchange);

impl FinalizeHook<MemoryTx, SendPayload> for SendOutcome {
    fn name(&self) -> &str {
        "exchange.send_outcome"
    }

    async fn after_applied(
        &self,
        tx: &mut MemoryTx,
        event: &FinalizeEvent<'_, SendPayload>,
    ) -> Result<(), BoxError> {
        let job = event.job;
        let linked = self.0.domain.lock().unwrap().jobs.get(&job.id.0).copied();
        let Some(id) = linked else {
            return Err(format!("send job {} has no transaction", job.id).into());
        };
        if let (Some(kind), Payload::Parsed(payload)) =
            (FailureKind::of_outcome(event.action), &event.payload)
        {
            self.0.record_failure(tx, id, &payload.correlation_id, kind);
        }
        let Some((mut event_type, mut status)) = EventType::for_outcome(event.action) else {
            return Ok(());
        };
        let key = self
            .0
            .domain
            .lock()
            .unwrap()
            .transactions
            .get(&id)
            .map(|t| t.correlation_id.clone());
        let own_payload = match &event.payload {
            Payload::Parsed(payload)
                if payload.transaction_id == id
                    && Some(&payload.correlation_id) == key.as_ref() =>
            {
                true
            }
            Payload::Parsed(_) => {
                if status != TransactionStatus::Failed {
                    events::payload_mismatch(job.id.0, id);
                }
                false
            }
            Payload::Malformed => false,
        };
        if !own_payload {
            (event_type, status) = (EventType::Failed, TransactionStatus::Failed);
        }
        if self.0.stamp_transaction(tx, id, status) {
            self.0.stage(tx, id, event_type, job);
        } else {
            guard_refused(id, status, job.id.0);
        }
        Ok(())
    }

    /// An operator reopens a send job: its transaction follows by `retry_failed_transaction`'s
    /// rules (only a failed one, only through its latest send job), and the job carries the
    /// transaction's transmission again.
    async fn after_reopened(
        &self,
        tx: &mut MemoryTx,
        event: &ReopenEvent<'_, SendPayload>,
    ) -> Result<(), BoxError> {
        let job = event.job.id;
        let (transaction, latest) = {
            let domain = self.0.domain.lock().unwrap();
            let Some(&transaction) = domain.jobs.get(&job.0) else {
                return Err(format!("send job {job} has no transaction").into());
            };
            let latest = domain
                .jobs
                .iter()
                .filter(|(_, owner)| **owner == transaction)
                .map(|(id, _)| *id)
                .max();
            (transaction, latest)
        };
        if latest != Some(job.0) {
            return Err(format!(
                "send job {job} is not the latest of transaction {transaction}: retry that one"
            )
            .into());
        }
        let view = match self.0.reopen_transaction(tx, transaction) {
            Ok(view) => view,
            Err(status) => {
                let status = status.map_or("missing", TransactionStatus::as_str);
                return Err(format!(
                    "transaction {transaction} is {status}: only a failed transaction can be retried"
                )
                .into());
            }
        };
        tx.update_payload(job, serde_json::to_value(transmission(&view))?);
        Ok(())
    }
}

impl ExchangeStore for MemExchange {
    type Backend = MemoryBackend;

    fn queue(&self) -> &MemoryBackend {
        &self.queue
    }

    fn hooks(&self) -> Hooks<MemoryTx, SendPayload> {
        Hooks::new().with(SendOutcome(self.clone()))
    }

    async fn transaction_of_job(
        &self,
        job_id: i64,
    ) -> Result<Option<TransactionView>, ExchangeError> {
        let domain = self.domain.lock().unwrap();
        Ok(domain
            .jobs
            .get(&job_id)
            .and_then(|id| domain.transactions.get(id))
            .cloned())
    }

    async fn send_jobs(&self, transaction_id: i64) -> Result<Vec<i64>, ExchangeError> {
        let domain = self.domain.lock().unwrap();
        let mut jobs: Vec<i64> = domain
            .jobs
            .iter()
            .filter(|(_, owner)| **owner == transaction_id)
            .map(|(job, _)| *job)
            .collect();
        jobs.sort_unstable();
        Ok(jobs)
    }

    async fn create_transactions(
        &self,
        requests: &[(String, i64)],
    ) -> Result<Vec<i64>, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let mut ids = Vec::with_capacity(requests.len());
        for (partner, amount_minor) in requests {
            let view = self.new_transaction(&mut tx, partner, *amount_minor);
            self.enqueue_send(&mut tx, &view).await?;
            ids.push(view.id);
        }
        tx.commit().await?;
        Ok(ids)
    }

    async fn retry_failed_transaction(&self, id: i64) -> Result<RetryOutcome, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let view = match self.reopen_transaction(&mut tx, id) {
            Ok(view) => view,
            Err(None) => return Ok(RetryOutcome::NotFound),
            Err(Some(status)) => return Ok(RetryOutcome::NotFailed(status)),
        };
        let send_job_id = self.enqueue_send(&mut tx, &view).await?;
        tx.commit().await?;
        Ok(RetryOutcome::Retried {
            send_job_id,
            key_kept: view.send_failure.is_some(),
            correlation_id: view.correlation_id,
        })
    }

    async fn transaction(&self, id: i64) -> Result<Option<TransactionView>, ExchangeError> {
        Ok(self.domain.lock().unwrap().transactions.get(&id).cloned())
    }

    async fn events(&self, id: i64) -> Result<Vec<EventView>, ExchangeError> {
        Ok(self
            .domain
            .lock()
            .unwrap()
            .outbox
            .iter()
            .filter(|e| e.transaction_id == id)
            .cloned()
            .collect())
    }

    async fn summary(&self) -> Result<ExchangeSummary, ExchangeError> {
        let domain = self.domain.lock().unwrap();
        let mut summary = ExchangeSummary::default();
        for row in domain.transactions.values() {
            match row.status {
                TransactionStatus::Pending => summary.pending += 1,
                TransactionStatus::Success => summary.success += 1,
                TransactionStatus::Failed => summary.failed += 1,
            }
        }
        // Keys with an `exchange.sent` so far, and those with a failure staged after one.
        let mut sent_keys: HashSet<&str> = HashSet::new();
        let mut conflicting: HashSet<&str> = HashSet::new();
        let mut jobs: HashSet<i64> = HashSet::new();
        for event in &domain.outbox {
            match event.event_type {
                EventType::Sent => summary.sent_events += 1,
                EventType::Failed => summary.failed_events += 1,
            }
            let key = event.correlation_id.as_str();
            match event.event_type {
                EventType::Sent if !sent_keys.insert(key) => summary.duplicate_events += 1,
                EventType::Failed if sent_keys.contains(key) => {
                    conflicting.insert(key);
                }
                _ => {}
            }
            if !jobs.insert(event.send_job_id) {
                summary.duplicate_events += 1;
            }
        }
        summary.conflicting_events = conflicting.len() as u64;
        Ok(summary)
    }
}
