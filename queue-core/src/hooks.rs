//! Finalize hooks: side effects that commit with a job's fenced write, and only after it applied.
//!
//! A side effect (an outbox event, a domain status) written by a worker that no longer owns the
//! job is how a queue double-reports. Hooks close that structurally: [`finalize_with_hooks`]
//! runs the fenced write first and hands the open transaction to the hooks only when the write
//! reported [`FinalizeOutcome::Applied`]. On `Stale` the transaction is rolled back and no hook
//! runs; if any hook fails, the fenced write rolls back with it.
//!
//! A hook is bound to what it needs: the backend's transaction type `Tx` (so one hook written
//! against a transaction type serves every backend that uses it) and the job's payload type `P`
//! (it receives the payload already parsed, or [`Payload::Malformed`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;

use crate::backend::{Backend, BackendTx};
use crate::error::{BoxError, Error, Result};
use crate::events;
use crate::types::{
    CANCELLED_BY_OPERATOR, CancelOutcome, CancelTarget, Claim, ClaimedJob, Finalize,
    FinalizeOutcome,
};

/// A job's payload as a hook sees it.
#[derive(Debug)]
pub enum Payload<'a, P> {
    /// The stored payload, parsed into the handler's type.
    Parsed(&'a P),
    /// The stored payload does not parse into the handler's type (the job is being failed as
    /// malformed, or ended `dead` without having run). The raw JSON is still in
    /// [`FinalizeEvent::job`].
    Malformed,
}

impl<'a, P> Payload<'a, P> {
    /// The parsed payload, if it parsed.
    pub fn parsed(&self) -> Option<&'a P> {
        match self {
            Payload::Parsed(payload) => Some(payload),
            Payload::Malformed => None,
        }
    }
}

impl<P> Clone for Payload<'_, P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P> Copy for Payload<'_, P> {}

/// What a hook is told about the write that just applied.
#[derive(Debug)]
pub struct FinalizeEvent<'a, P> {
    /// The job as it was claimed (id, generation, attempts, raw payload).
    pub job: &'a ClaimedJob,
    /// The payload, parsed into the handler's type.
    pub payload: Payload<'a, P>,
    /// The write that applied.
    pub action: &'a Finalize,
}

/// What a hook is told when an operator reopened a job ([`crate::retry_with_hooks`]).
#[derive(Debug)]
pub struct ReopenEvent<'a, P> {
    /// The job as reopened: `pending`, attempts reset.
    pub job: &'a crate::types::JobRecord,
    /// The status it was reopened from (`dead`, `failed` or `cancelled`).
    pub previous: crate::types::JobStatus,
    /// The payload, parsed into the handler's type.
    pub payload: Payload<'a, P>,
}

/// A side effect that must commit atomically with a job's outcome: a domain status, an outbox
/// row, an audit row.
///
/// It runs inside the finalize transaction, after the fenced write applied, never on `Stale`.
/// Returning an error rolls back the whole finalize (the job stays in flight under its claim,
/// and the worker tries the finalize again or, failing that, the lease lapses).
///
/// A hook that stages writes must make them through `tx` (for the in-memory backend, through
/// [`crate::MemoryTx`]); a write on another connection would not roll back with the job.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use queue_core::{BoxError, FinalizeEvent, FinalizeHook, Finalize, MemoryTx};
///
/// /// Counts completions, committed only with the job's own write.
/// struct CountCompleted(Arc<AtomicU64>);
///
/// impl FinalizeHook<MemoryTx, serde_json::Value> for CountCompleted {
///     async fn after_applied(
///         &self,
///         tx: &mut MemoryTx,
///         event: &FinalizeEvent<'_, serde_json::Value>,
///     ) -> Result<(), BoxError> {
///         if matches!(event.action, Finalize::Complete) {
///             let counter = self.0.clone();
///             tx.on_commit(move || { counter.fetch_add(1, Ordering::SeqCst); });
///         }
///         Ok(())
///     }
/// }
/// ```
pub trait FinalizeHook<Tx, P>: Send + Sync + 'static {
    /// A name for logs and errors; the type name by default.
    fn name(&self) -> &str {
        std::any::type_name::<Self>()
    }

    /// Runs inside the finalize transaction after the fenced write applied.
    fn after_applied(
        &self,
        tx: &mut Tx,
        event: &FinalizeEvent<'_, P>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Runs inside the transaction in which an operator reopened a job that had ended
    /// ([`crate::retry_with_hooks`]), so that domain state follows it back (a failed domain
    /// row made pending again). An error refuses the retry: nothing changes. Does nothing by
    /// default.
    fn after_reopened(
        &self,
        tx: &mut Tx,
        event: &ReopenEvent<'_, P>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        let _ = (tx, event);
        async { Ok(()) }
    }

    /// Runs inside one transaction for many jobs whose fenced writes all applied (a worker
    /// writing outcomes in batches), in order: override it to write a whole batch's rows in
    /// one statement. By default [`FinalizeHook::after_applied`] for each event in turn. An
    /// error rolls the whole transaction back; the worker then writes each job again with a
    /// savepoint of its own, through `after_applied`, so that only the job whose hook fails
    /// waits. A hook may thus see a job again after a rolled-back try: keep its effects
    /// inside the transaction.
    fn after_applied_batch(
        &self,
        tx: &mut Tx,
        events: &[FinalizeEvent<'_, P>],
    ) -> impl Future<Output = Result<(), BoxError>> + Send
    where
        Tx: Send,
        P: Sync,
    {
        async move {
            for event in events {
                self.after_applied(tx, event).await?;
            }
            Ok(())
        }
    }
}

type HookFuture<'a> = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send + 'a>>;

/// [`FinalizeHook`] with its future boxed, so that hooks of different types share one list.
trait DynHook<Tx, P>: Send + Sync {
    fn name(&self) -> &str;
    fn run<'a>(&'a self, tx: &'a mut Tx, event: &'a FinalizeEvent<'a, P>) -> HookFuture<'a>;
    fn run_reopened<'a>(&'a self, tx: &'a mut Tx, event: &'a ReopenEvent<'a, P>) -> HookFuture<'a>;
    fn run_batch<'a>(
        &'a self,
        tx: &'a mut Tx,
        events: &'a [FinalizeEvent<'a, P>],
    ) -> HookFuture<'a>;
}

impl<Tx: Send, P: Sync, T: FinalizeHook<Tx, P>> DynHook<Tx, P> for T {
    fn name(&self) -> &str {
        FinalizeHook::name(self)
    }

    fn run<'a>(&'a self, tx: &'a mut Tx, event: &'a FinalizeEvent<'a, P>) -> HookFuture<'a> {
        Box::pin(self.after_applied(tx, event))
    }

    fn run_reopened<'a>(&'a self, tx: &'a mut Tx, event: &'a ReopenEvent<'a, P>) -> HookFuture<'a> {
        Box::pin(self.after_reopened(tx, event))
    }

    fn run_batch<'a>(
        &'a self,
        tx: &'a mut Tx,
        events: &'a [FinalizeEvent<'a, P>],
    ) -> HookFuture<'a> {
        Box::pin(self.after_applied_batch(tx, events))
    }
}

/// An ordered list of hooks; they run in the order added and the first error stops the rest.
pub struct Hooks<Tx, P> {
    hooks: Vec<Arc<dyn DynHook<Tx, P>>>,
}

impl<Tx, P> Hooks<Tx, P> {
    /// No hooks.
    pub fn new() -> Self {
        Hooks { hooks: Vec::new() }
    }

    /// Adds a hook after the existing ones.
    pub fn push(&mut self, hook: impl FinalizeHook<Tx, P>)
    where
        Tx: Send,
        P: Sync,
    {
        self.hooks.push(Arc::new(hook));
    }

    /// Adds a hook, builder style.
    pub fn with(mut self, hook: impl FinalizeHook<Tx, P>) -> Self
    where
        Tx: Send,
        P: Sync,
    {
        self.push(hook);
        self
    }

    /// True when there is no hook.
    pub fn is_empty(&self) -> bool {
        self.hooks.is_empty()
    }

    /// How many hooks there are.
    pub fn len(&self) -> usize {
        self.hooks.len()
    }

    /// Runs every hook in order inside `tx`.
    pub async fn run(&self, tx: &mut Tx, event: &FinalizeEvent<'_, P>) -> Result<()> {
        for hook in &self.hooks {
            hook.run(tx, event).await.map_err(failed(&**hook))?;
        }
        Ok(())
    }

    /// Runs every hook in order inside `tx` for `events`, each hook once for all of them
    /// ([`FinalizeHook::after_applied_batch`]).
    pub async fn run_batch(&self, tx: &mut Tx, events: &[FinalizeEvent<'_, P>]) -> Result<()> {
        for hook in &self.hooks {
            hook.run_batch(tx, events).await.map_err(failed(&**hook))?;
        }
        Ok(())
    }
}

impl<Tx, P> Hooks<Tx, P> {
    /// Runs every hook's [`FinalizeHook::after_reopened`] in order inside `tx`.
    pub async fn run_reopened(&self, tx: &mut Tx, event: &ReopenEvent<'_, P>) -> Result<()> {
        for hook in &self.hooks {
            hook.run_reopened(tx, event)
                .await
                .map_err(failed(&**hook))?;
        }
        Ok(())
    }
}

/// What a hook's error becomes: [`Error::Hook`], naming it.
fn failed<Tx, P>(hook: &dyn DynHook<Tx, P>) -> impl FnOnce(BoxError) -> Error + '_ {
    move |source| Error::Hook {
        hook: hook.name().to_owned(),
        source,
    }
}

impl<Tx, P> Default for Hooks<Tx, P> {
    fn default() -> Self {
        Hooks::new()
    }
}

impl<Tx, P> Clone for Hooks<Tx, P> {
    fn clone(&self) -> Self {
        Hooks {
            hooks: self.hooks.clone(),
        }
    }
}

impl<Tx, P> std::fmt::Debug for Hooks<Tx, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.hooks.iter().map(|h| h.name()))
            .finish()
    }
}

/// The fenced finalize: one transaction holding the fenced write and then, only if it applied,
/// every hook; the outcome's event is emitted (see [`crate::events`]).
///
/// * `Applied`: hooks ran and everything committed.
/// * `Stale`: rolled back, no hook ran, the event `queue.stale_finalize_fenced` was emitted.
/// * `Err`: nothing committed (a hook failed, or the backend did).
pub async fn finalize_with_hooks<B, P>(
    backend: &B,
    hooks: &Hooks<B::Tx, P>,
    job: &ClaimedJob,
    action: &Finalize,
) -> Result<FinalizeOutcome>
where
    B: Backend,
    P: DeserializeOwned + Sync,
{
    let outcome = finalize_once(backend, hooks, job, action).await?;
    events::finalized(backend.queue(), job.claim(), action, outcome);
    Ok(outcome)
}

/// Administrative cancel with the finalize hooks: a `pending` job is cancelled and the hooks
/// run in the same transaction (they see [`Finalize::Cancel`]), so domain state follows the
/// job; a job in flight gets a cancel request, carried out by its holder with the hooks of its
/// worker. A hook error rolls the cancel back.
pub async fn cancel_with_hooks<B, P>(
    backend: &B,
    hooks: &Hooks<B::Tx, P>,
    id: crate::types::JobId,
) -> Result<CancelOutcome>
where
    B: Backend,
    P: DeserializeOwned + Sync,
{
    let mut tx = backend.begin().await?;
    let target = backend.cancel_in(&mut tx, id).await?;
    if let CancelTarget::Cancelled(job) = &target
        && !hooks.is_empty()
    {
        let action = Finalize::Cancel {
            reason: CANCELLED_BY_OPERATOR.to_owned(),
        };
        let parsed = P::deserialize(&job.payload).ok();
        let event = FinalizeEvent {
            job,
            payload: parsed.as_ref().map_or(Payload::Malformed, Payload::Parsed),
            action: &action,
        };
        if let Err(err) = hooks.run(&mut tx, &event).await {
            let _ = tx.rollback().await;
            return Err(err);
        }
    }
    tx.commit().await?;
    let outcome = target.outcome();
    events::cancelled(backend.queue(), id, outcome);
    Ok(outcome)
}

/// [`finalize_with_hooks`] without the event: the worker's finalizer emits its own. Without
/// hooks, the write is the backend's single-statement [`Backend::finalize`].
pub(crate) async fn finalize_once<B, P>(
    backend: &B,
    hooks: &Hooks<B::Tx, P>,
    job: &ClaimedJob,
    action: &Finalize,
) -> Result<FinalizeOutcome>
where
    B: Backend,
    P: DeserializeOwned + Sync,
{
    if hooks.is_empty() {
        return backend.finalize(job.claim(), action).await;
    }
    let mut tx = backend.begin().await?;
    let outcome = backend.finalize_in(&mut tx, job.claim(), action).await?;
    if outcome == FinalizeOutcome::Stale {
        tx.rollback().await?;
        return Ok(FinalizeOutcome::Stale);
    }
    let parsed = P::deserialize(&job.payload).ok();
    let event = FinalizeEvent {
        job,
        payload: parsed.as_ref().map_or(Payload::Malformed, Payload::Parsed),
        action,
    };
    if let Err(err) = hooks.run(&mut tx, &event).await {
        // The rollback's own failure is secondary: the hook error is what the caller must see.
        let _ = tx.rollback().await;
        return Err(err);
    }
    tx.commit().await?;
    Ok(FinalizeOutcome::Applied)
}

/// Fenced writes of many jobs with `hooks`, in one transaction and one commit. First all at
/// once: one batched write ([`Backend::finalize_many_in`]) and each hook once for every job
/// that applied ([`FinalizeHook::after_applied_batch`]). If a hook refuses that, the
/// transaction is rolled back and the jobs are written again in a new one, a savepoint before
/// each: a job whose hook fails is rolled back to its savepoint alone (its answer is that
/// hook's error) and the others commit. Answers in input order. An error of the whole call
/// (beginning, a fenced write, a savepoint, the commit) means nothing is known: the commit
/// may have applied every write. For a backend with [`Backend::savepoints`].
pub(crate) async fn finalize_batch<B, P>(
    backend: &B,
    hooks: &Hooks<B::Tx, P>,
    items: &[(&ClaimedJob, &Finalize)],
) -> Result<Vec<Result<FinalizeOutcome>>>
where
    B: Backend,
    P: DeserializeOwned + Sync,
{
    let parsed: Vec<Option<P>> = items
        .iter()
        .map(|(job, _)| P::deserialize(&job.payload).ok())
        .collect();
    let event = |i: usize| FinalizeEvent {
        job: items[i].0,
        payload: parsed[i]
            .as_ref()
            .map_or(Payload::Malformed, Payload::Parsed),
        action: items[i].1,
    };
    let writes: Vec<(Claim, Finalize)> = items
        .iter()
        .map(|(job, action)| (job.claim(), (*action).clone()))
        .collect();
    let mut tx = backend.begin().await?;
    let outcomes = backend.finalize_many_in(&mut tx, &writes).await?;
    let applied: Vec<FinalizeEvent<'_, P>> = (0..items.len())
        .filter(|&i| outcomes[i] == FinalizeOutcome::Applied)
        .map(event)
        .collect();
    match hooks.run_batch(&mut tx, &applied).await {
        Ok(()) => {
            tx.commit().await?;
            return Ok(outcomes.into_iter().map(Ok).collect());
        }
        Err(err @ Error::Hook { .. }) => {
            // Which job the hook refused is not known: each gets a savepoint of its own.
            let _ = tx.rollback().await;
            events::finalize_retry(backend.queue(), items.len(), &err, Duration::ZERO);
        }
        Err(err) => return Err(err),
    }
    let mut tx = backend.begin().await?;
    let mut answers = Vec::with_capacity(items.len());
    for (i, &(job, action)) in items.iter().enumerate() {
        tx.savepoint().await?;
        if backend.finalize_in(&mut tx, job.claim(), action).await? == FinalizeOutcome::Stale {
            answers.push(Ok(FinalizeOutcome::Stale));
            continue;
        }
        match hooks.run(&mut tx, &event(i)).await {
            Ok(()) => answers.push(Ok(FinalizeOutcome::Applied)),
            Err(err) => {
                tx.rollback_to_savepoint().await?;
                answers.push(Err(err));
            }
        }
    }
    tx.commit().await?;
    Ok(answers)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use serde_json::{Value, json};

    use super::*;
    use crate::memory::{MemoryBackend, MemoryTx};
    use crate::types::{ClaimRequest, JobStatus, Lease, NewJob};

    /// Records each batch it is given (the jobs' `n`), and refuses a batch holding `refuse`
    /// once.
    #[derive(Clone, Default)]
    struct Batches {
        seen: Arc<Mutex<Vec<Vec<i64>>>>,
        refuse: Option<i64>,
        refused: Arc<Mutex<bool>>,
    }

    impl FinalizeHook<MemoryTx, Value> for Batches {
        async fn after_applied(
            &self,
            tx: &mut MemoryTx,
            event: &FinalizeEvent<'_, Value>,
        ) -> Result<(), BoxError> {
            self.after_applied_batch(tx, std::slice::from_ref(event))
                .await
        }

        async fn after_applied_batch(
            &self,
            _tx: &mut MemoryTx,
            events: &[FinalizeEvent<'_, Value>],
        ) -> Result<(), BoxError> {
            let ns: Vec<i64> = events
                .iter()
                .map(|e| e.job.payload["n"].as_i64().unwrap())
                .collect();
            if let Some(refuse) = self.refuse
                && ns.contains(&refuse)
                && !std::mem::replace(&mut *self.refused.lock().unwrap(), true)
            {
                return Err("refused once".into());
            }
            self.seen.lock().unwrap().push(ns);
            Ok(())
        }
    }

    async fn claimed(backend: &MemoryBackend, n: usize) -> Vec<ClaimedJob> {
        let jobs = (0..n as i64)
            .map(|n| NewJob::from_value(json!({ "n": n })))
            .collect();
        backend.enqueue_many(jobs).await.unwrap();
        let request = ClaimRequest::new(n as u32, Lease::DEFAULT);
        backend.claim(request).await.unwrap().jobs
    }

    #[tokio::test]
    async fn a_batch_runs_each_hook_once_for_every_job_that_applied() {
        let backend = MemoryBackend::new();
        let jobs = claimed(&backend, 3).await;
        let stale = Claim {
            token: crate::ClaimToken(jobs[1].token.0 ^ 1),
            ..jobs[1].claim()
        };
        let hook = Batches::default();
        let hooks = Hooks::new().with(hook.clone());
        let mut ghost = jobs[1].clone();
        ghost.token = stale.token;
        let complete = Finalize::Complete;
        let items = [
            (&jobs[0], &complete),
            (&ghost, &complete),
            (&jobs[2], &complete),
        ];
        let answers = finalize_batch(&backend, &hooks, &items).await.unwrap();
        let answers: Vec<FinalizeOutcome> = answers.into_iter().map(Result::unwrap).collect();
        use FinalizeOutcome::{Applied, Stale};
        assert_eq!(answers, [Applied, Stale, Applied]);
        assert_eq!(*hook.seen.lock().unwrap(), [vec![0, 2]]);
    }

    #[tokio::test]
    async fn a_refused_batch_is_written_again_a_savepoint_per_job() {
        let backend = MemoryBackend::new();
        let jobs = claimed(&backend, 3).await;
        let hook = Batches {
            refuse: Some(1),
            ..Batches::default()
        };
        let hooks = Hooks::new().with(hook.clone());
        let complete = Finalize::Complete;
        let items: Vec<(&ClaimedJob, &Finalize)> = jobs.iter().map(|j| (j, &complete)).collect();
        let answers = finalize_batch(&backend, &hooks, &items).await.unwrap();
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        // Refused once as a batch, then one job at a time.
        assert_eq!(*hook.seen.lock().unwrap(), [vec![0], vec![1], vec![2]]);
        for job in &jobs {
            let record = backend.get(job.id).await.unwrap().unwrap();
            assert_eq!(record.status, JobStatus::Completed);
        }
    }
}
