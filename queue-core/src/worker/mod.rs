//! The worker runtime: claim, run, finalize (fenced), heartbeat, shut down gracefully.
//!
//! A started worker is one dispatcher task ([`dispatcher`]) that claims jobs and spawns one task
//! per running job ([`runner`]); every outcome goes through one [`finalizer`], which batches the
//! writes of jobs without hooks in a task of its own, and every lease renewal through one
//! [`renewer`], many to a call. [`shutdown`] ends what the dispatcher holds.

pub(crate) mod config;
mod dispatcher;
mod finalizer;
mod renewer;
mod runner;
mod shutdown;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use config::WorkerConfig;
pub use stats::{ShutdownReport, WorkerStats};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::events;
use crate::handler::Handler;
use crate::hooks::{FinalizeHook, Hooks};
use crate::metrics::QueueMetrics;
use dispatcher::Dispatcher;
use finalizer::Finalizer;
use renewer::Renewer;

/// A worker: claims jobs of one queue and runs them with a handler.
///
/// ```
/// use queue_core::{Backend, Handler, JobContext, JobError, MemoryBackend, NewJob, Worker, WorkerConfig};
///
/// struct Greet;
/// impl Handler for Greet {
///     type Payload = String;
///     async fn handle(&self, _ctx: JobContext, name: String) -> Result<(), JobError> {
///         assert!(!name.is_empty());
///         Ok(())
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> queue_core::Result<()> {
/// let queue = MemoryBackend::new();
/// queue.enqueue(NewJob::new("ada")?).await?;
/// let worker = Worker::new(queue.clone(), Greet, WorkerConfig::default())?.start();
/// worker.wait_for(|stats| stats.completed == 1).await;
/// worker.shutdown().await?;
/// assert_eq!(queue.counts().await?.completed, 1);
/// # Ok(()) }
/// ```
pub struct Worker<B: Backend, H: Handler> {
    backend: B,
    handler: Arc<H>,
    hooks: Hooks<B::Tx, H::Payload>,
    config: WorkerConfig,
}

impl<B: Backend, H: Handler> Worker<B, H> {
    /// A worker for `backend`'s queue; refuses an invalid `config` with a clear error.
    pub fn new(backend: B, handler: H, config: WorkerConfig) -> Result<Self> {
        config.validate(handler.runs_long())?;
        Ok(Worker {
            backend,
            handler: Arc::new(handler),
            hooks: Hooks::new(),
            config,
        })
    }

    /// Adds a finalize hook (runs after the fenced write applied, in its transaction).
    pub fn hook(mut self, hook: impl FinalizeHook<B::Tx, H::Payload>) -> Self {
        self.hooks.push(hook);
        self
    }

    /// Replaces the hooks.
    pub fn hooks(mut self, hooks: Hooks<B::Tx, H::Payload>) -> Self {
        self.hooks = hooks;
        self
    }

    /// Starts the worker on the current tokio runtime.
    pub fn start(self) -> WorkerHandle {
        // The store learns that this queue is served (for the admin API's list), best effort.
        let served = self.backend.clone();
        tokio::spawn(async move {
            let _ = served.note_served().await;
        });
        let (stats_tx, stats_rx) = watch::channel(WorkerStats::default());
        let stop = CancellationToken::new();
        let metrics = QueueMetrics::new(self.backend.queue());
        let (finalizer, batch_task) = Finalizer::start(
            self.backend.clone(),
            self.hooks,
            (stats_tx.clone(), metrics.clone()),
            self.config.lease.duration(),
            (
                self.config.batch_finalize,
                self.config.fuse_claims,
                self.config.slots(),
            ),
        );
        let renewer = Renewer::start(self.backend.clone(), self.config.lease);
        let shared = Arc::new(Shared {
            renewer,
            backend: self.backend,
            handler: self.handler,
            config: self.config,
            finalizer,
            stats: stats_tx,
            metrics,
        });
        let task = tokio::spawn(run(shared, stop.clone(), batch_task));
        WorkerHandle {
            stop,
            task: Some(task),
            stats: stats_rx,
        }
    }
}

/// What the dispatcher, the job tasks and shutdown share.
struct Shared<B: Backend, H: Handler> {
    backend: B,
    handler: Arc<H>,
    config: WorkerConfig,
    finalizer: Finalizer<B, H::Payload>,
    /// Every lease renewal goes through it, many to a call.
    renewer: Renewer,
    stats: watch::Sender<WorkerStats>,
    metrics: QueueMetrics,
}

/// The worker's life: dispatch until asked to stop, then shut down.
async fn run<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    stop: CancellationToken,
    batch_task: Option<finalizer::BatchTask>,
) -> ShutdownReport {
    let mut dispatcher = Dispatcher::new(shared.clone());
    dispatcher.run(&stop).await;
    let (report, end) = shutdown::shut_down(&mut dispatcher, Instant::now()).await;
    // Every job task has ended, so no more outcomes come: let the batches be written.
    if let Some(batch_task) = batch_task {
        batch_task.finish(end).await;
    }
    let report = ShutdownReport {
        stats: *shared.stats.borrow(),
        ..report
    };
    events::worker_stopped(
        shared.backend.queue(),
        report.released_unstarted,
        report.finished_in_time,
        report.aborted,
    );
    report
}

/// Controls a started worker. Dropping it asks the worker to shut down without waiting.
pub struct WorkerHandle {
    stop: CancellationToken,
    task: Option<JoinHandle<ShutdownReport>>,
    stats: watch::Receiver<WorkerStats>,
}

/// [`WorkerHandle::wait_for_timeout`] gave up: the condition did not hold in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the worker's counters did not reach the condition within {waited:?}; last: {last:?}")]
pub struct WaitTimedOut {
    /// How long it waited.
    pub waited: Duration,
    /// The counters when it gave up.
    pub last: WorkerStats,
}

impl WorkerHandle {
    /// The counters so far.
    pub fn stats(&self) -> WorkerStats {
        *self.stats.borrow()
    }

    /// Waits until the counters satisfy `condition` (how tests and demos await progress without
    /// sleeping). Returns the counters that satisfied it. Waits forever if they never do: tests
    /// should prefer [`WorkerHandle::wait_for_timeout`].
    pub async fn wait_for(&self, condition: impl FnMut(&WorkerStats) -> bool) -> WorkerStats {
        let mut rx = self.stats.clone();
        *rx.wait_for(condition)
            .await
            .expect("the worker keeps its stats channel open until dropped")
    }

    /// Like [`WorkerHandle::wait_for`], but gives up after `timeout` with the last counters, so
    /// that a broken test fails instead of hanging.
    pub async fn wait_for_timeout(
        &self,
        timeout: Duration,
        condition: impl FnMut(&WorkerStats) -> bool,
    ) -> Result<WorkerStats, WaitTimedOut> {
        tokio::time::timeout(timeout, self.wait_for(condition))
            .await
            .map_err(|_| WaitTimedOut {
                waited: timeout,
                last: self.stats(),
            })
    }

    /// Asks the worker to stop claiming and begin the graceful shutdown; returns at once.
    pub fn request_shutdown(&self) {
        self.stop.cancel();
    }

    /// Graceful shutdown: stop claiming, release claimed-but-unstarted jobs (fenced), let running
    /// jobs finish within `shutdown_timeout`, then cancel, then abort and release what is left.
    pub async fn shutdown(mut self) -> Result<ShutdownReport> {
        self.stop.cancel();
        let task = self.task.take().expect("shutdown runs once");
        task.await.map_err(|_| Error::Shutdown)
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
