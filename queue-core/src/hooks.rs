//! Finalize hooks: side effects that commit with a job's fenced write, and only after it applied.
//!
//! The seed incident's second defect was a side effect (an outbox event, a domain status) written
//! by a worker that no longer owned the job. Hooks close it structurally: [`finalize_with_hooks`]
//! runs the fenced write first and hands the open transaction to the hooks only when the write
//! reported [`FinalizeOutcome::Applied`]. On `Stale` the transaction is rolled back and no hook
//! runs; if any hook fails, the fenced write rolls back with it.

use std::sync::Arc;

use async_trait::async_trait;

use crate::backend::{Backend, BackendTx};
use crate::error::{BoxError, Error, Result};
use crate::events;
use crate::types::{ClaimedJob, Finalize, FinalizeOutcome};

/// What a hook is told about the write that just applied.
#[derive(Debug, Clone, Copy)]
pub struct FinalizeEvent<'a> {
    /// The job as it was claimed (payload included).
    pub job: &'a ClaimedJob,
    /// The write that applied.
    pub action: &'a Finalize,
}

/// A side effect that must commit atomically with a job's outcome: a domain guard, an outbox
/// stager, an audit row.
///
/// It runs inside the finalize transaction, after the fenced write applied, never on `Stale`.
/// Returning an error rolls back the whole finalize (the job stays in flight under its claim, and
/// the worker retries the finalize or, failing that, the lease lapses).
///
/// A hook that stages writes must make them through `tx` (for the in-memory backend, through
/// [`crate::MemoryTx`]); a write on another connection would not roll back with the job.
///
/// ```
/// use async_trait::async_trait;
/// use queue_core::{BoxError, FinalizeEvent, FinalizeHook, Finalize, MemoryBackend, MemoryTx};
///
/// /// Counts completions, committed only with the job's own write.
/// struct CountCompleted(std::sync::Arc<std::sync::atomic::AtomicU64>);
///
/// #[async_trait]
/// impl FinalizeHook<MemoryBackend> for CountCompleted {
///     async fn after_applied(&self, tx: &mut MemoryTx, event: &FinalizeEvent<'_>) -> Result<(), BoxError> {
///         if matches!(event.action, Finalize::Complete) {
///             let counter = self.0.clone();
///             tx.on_commit(move || { counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst); });
///         }
///         Ok(())
///     }
/// }
/// ```
#[async_trait]
pub trait FinalizeHook<B: Backend>: Send + Sync + 'static {
    /// A name for logs and errors; the type name by default.
    fn name(&self) -> &str {
        std::any::type_name::<Self>()
    }

    /// Runs inside the finalize transaction after the fenced write applied.
    async fn after_applied(
        &self,
        tx: &mut B::Tx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError>;
}

/// An ordered list of hooks; they run in the order added and the first error stops the rest.
pub struct Hooks<B: Backend> {
    hooks: Vec<Arc<dyn FinalizeHook<B>>>,
}

impl<B: Backend> Hooks<B> {
    /// No hooks.
    pub fn new() -> Self {
        Hooks { hooks: Vec::new() }
    }

    /// Adds a hook after the existing ones.
    pub fn push(&mut self, hook: impl FinalizeHook<B>) {
        self.hooks.push(Arc::new(hook));
    }

    /// Adds a shared hook after the existing ones.
    pub fn push_arc(&mut self, hook: Arc<dyn FinalizeHook<B>>) {
        self.hooks.push(hook);
    }

    /// Adds a hook, builder style.
    pub fn with(mut self, hook: impl FinalizeHook<B>) -> Self {
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
    pub async fn run(&self, tx: &mut B::Tx, event: &FinalizeEvent<'_>) -> Result<()> {
        for hook in &self.hooks {
            hook.after_applied(tx, event)
                .await
                .map_err(|source| Error::Hook {
                    hook: hook.name().to_owned(),
                    source,
                })?;
        }
        Ok(())
    }
}

impl<B: Backend> Default for Hooks<B> {
    fn default() -> Self {
        Hooks::new()
    }
}

impl<B: Backend> Clone for Hooks<B> {
    fn clone(&self) -> Self {
        Hooks {
            hooks: self.hooks.clone(),
        }
    }
}

impl<B: Backend> std::fmt::Debug for Hooks<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.hooks.iter().map(|h| h.name()))
            .finish()
    }
}

/// The fenced finalize: one transaction holding the fenced write and then, only if it applied,
/// every hook.
///
/// * `Applied`: hooks ran and everything committed.
/// * `Stale`: rolled back, no hook ran, the event `queue.stale_finalize_fenced` was emitted.
/// * `Err`: nothing committed (a hook failed, or the backend did).
pub async fn finalize_with_hooks<B: Backend>(
    backend: &B,
    hooks: &Hooks<B>,
    job: &ClaimedJob,
    action: &Finalize,
) -> Result<FinalizeOutcome> {
    let mut tx = backend.begin().await?;
    let outcome = backend.finalize_in(&mut tx, job.claim(), action).await?;
    if outcome == FinalizeOutcome::Stale {
        tx.rollback().await?;
        events::stale_finalize_fenced(backend.queue(), job.claim(), action);
        return Ok(FinalizeOutcome::Stale);
    }
    let event = FinalizeEvent { job, action };
    if let Err(err) = hooks.run(&mut tx, &event).await {
        // The rollback's own failure is secondary: the hook error is what the caller must see.
        let _ = tx.rollback().await;
        return Err(err);
    }
    tx.commit().await?;
    Ok(FinalizeOutcome::Applied)
}
