//! The exchange in process memory, on the in-memory queue backend: for the demo without a
//! database and for unit tests. Domain writes happen inside the queue's transaction (which holds
//! the store's lock) and are taken back with `MemoryTx::on_rollback` if it rolls back.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use queue_core::{
    Backend, BackendTx, BoxError, FinalizeEvent, FinalizeHook, Hooks, MemoryBackend, MemoryTx,
    NewJob,
};

use super::{
    EventType, EventView, ExchangeError, ExchangeStore, ExchangeSummary, RetryOutcome, SendPayload,
    TransactionStatus, TransactionView, guard_refused, queue_name,
};

#[derive(Default)]
struct Domain {
    next_id: i64,
    next_key: u64,
    transactions: BTreeMap<i64, TransactionView>,
    outbox: Vec<EventView>,
    /// The transactions whose status the terminal guard stamped in the open queue transaction
    /// (the store's lock serialises them): the outbox stages only for these.
    stamped_now: HashSet<i64>,
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
        domain.stamped_now.insert(id);
        let (undo, done) = (self.domain.clone(), self.domain.clone());
        tx.on_rollback(move || {
            let mut domain = undo.lock().unwrap();
            domain.stamped_now.remove(&id);
            if let Some(row) = domain.transactions.get_mut(&id) {
                row.status = previous;
            }
        });
        tx.on_commit(move || {
            done.lock().unwrap().stamped_now.remove(&id);
        });
        true
    }

    fn payload(view: &TransactionView) -> SendPayload {
        SendPayload {
            transaction_id: view.id,
            correlation_id: view.correlation_id.clone(),
            partner: view.partner.clone(),
            amount_minor: view.amount_minor,
        }
    }
}

struct MemTerminalGuard(MemExchange);

#[async_trait]
impl FinalizeHook<MemoryBackend> for MemTerminalGuard {
    fn name(&self) -> &str {
        "exchange.terminal_guard"
    }

    async fn after_applied(
        &self,
        tx: &mut MemoryTx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        let Some((_, status)) = EventType::for_outcome(event.action) else {
            return Ok(());
        };
        let id = transaction_of(event)?;
        if !self.0.stamp_transaction(tx, id, status) {
            guard_refused(id, status, event.job.id.0);
        }
        Ok(())
    }
}

struct MemOutboxStager(MemExchange);

#[async_trait]
impl FinalizeHook<MemoryBackend> for MemOutboxStager {
    fn name(&self) -> &str {
        "exchange.outbox"
    }

    async fn after_applied(
        &self,
        tx: &mut MemoryTx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        let Some((event_type, status)) = EventType::for_outcome(event.action) else {
            return Ok(());
        };
        let id = transaction_of(event)?;
        let mut domain = self.0.domain.lock().unwrap();
        if !domain.stamped_now.contains(&id) {
            // The guard refused (or nothing was stamped in this transaction): no event.
            return Ok(());
        }
        let Some(row) = domain
            .transactions
            .get(&id)
            .filter(|row| row.status == status)
        else {
            return Ok(());
        };
        let staged = EventView {
            event_type,
            transaction_id: id,
            correlation_id: row.correlation_id.clone(),
            send_job_id: event.job.id.0,
            claim_generation: event.job.generation.0,
        };
        domain.outbox.push(staged);
        let undo = self.0.domain.clone();
        tx.on_rollback(move || {
            undo.lock().unwrap().outbox.pop();
        });
        Ok(())
    }
}

fn transaction_of(event: &FinalizeEvent<'_>) -> Result<i64, BoxError> {
    event.job.payload["transaction_id"]
        .as_i64()
        .ok_or_else(|| "send job payload has no transaction_id".into())
}

impl ExchangeStore for MemExchange {
    type Backend = MemoryBackend;

    fn queue(&self) -> &MemoryBackend {
        &self.queue
    }

    fn hooks(&self) -> Hooks<MemoryBackend> {
        Hooks::new()
            .with(MemTerminalGuard(self.clone()))
            .with(MemOutboxStager(self.clone()))
    }

    async fn create_transactions(
        &self,
        requests: &[(String, i64)],
    ) -> Result<Vec<i64>, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let mut ids = Vec::with_capacity(requests.len());
        for (partner, amount_minor) in requests {
            let view = {
                let mut domain = self.domain.lock().unwrap();
                domain.next_id += 1;
                let view = TransactionView {
                    id: domain.next_id,
                    correlation_id: domain.new_key(),
                    partner: partner.clone(),
                    amount_minor: *amount_minor,
                    status: TransactionStatus::Pending,
                    retries: 0,
                };
                domain.transactions.insert(view.id, view.clone());
                view
            };
            let undo = self.domain.clone();
            let id = view.id;
            tx.on_rollback(move || {
                undo.lock().unwrap().transactions.remove(&id);
            });
            self.queue
                .enqueue_in(&mut tx, NewJob::new(&Self::payload(&view))?)
                .await?;
            ids.push(id);
        }
        tx.commit().await?;
        Ok(ids)
    }

    async fn retry_failed_transaction(&self, id: i64) -> Result<RetryOutcome, ExchangeError> {
        let mut tx = self.queue.begin().await?;
        let view = {
            let mut domain = self.domain.lock().unwrap();
            let key = domain.new_key();
            let Some(row) = domain.transactions.get_mut(&id) else {
                return Ok(RetryOutcome::NotFound);
            };
            if row.status != TransactionStatus::Failed {
                return Ok(RetryOutcome::NotFailed(row.status));
            }
            let previous = row.clone();
            row.status = TransactionStatus::Pending;
            row.correlation_id = key;
            row.retries += 1;
            let view = row.clone();
            let undo = self.domain.clone();
            tx.on_rollback(move || {
                undo.lock().unwrap().transactions.insert(id, previous);
            });
            view
        };
        let send_job_id = self
            .queue
            .enqueue_in(&mut tx, NewJob::new(&Self::payload(&view))?)
            .await?
            .id
            .0;
        tx.commit().await?;
        Ok(RetryOutcome::Retried {
            send_job_id,
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
        let mut types: HashMap<&str, HashSet<EventType>> = HashMap::new();
        let mut seen: HashSet<(&str, EventType)> = HashSet::new();
        for event in &domain.outbox {
            match event.event_type {
                EventType::Sent => summary.sent_events += 1,
                EventType::Failed => summary.failed_events += 1,
            }
            types
                .entry(&event.correlation_id)
                .or_default()
                .insert(event.event_type);
            if !seen.insert((&event.correlation_id, event.event_type)) {
                summary.duplicate_events += 1;
            }
        }
        summary.conflicting_events = types.values().filter(|t| t.len() > 1).count() as u64;
        Ok(summary)
    }
}
