//! The worker runtime: claim, run, finalize (fenced), heartbeat, shut down gracefully.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backend::Backend;
use crate::error::{ConfigError, Error, Result};
use crate::events;
use crate::handler::{ErrorAction, Handler, JobContext, JobError};
use crate::hooks::{FinalizeHook, Hooks, finalize_with_hooks};
use crate::retry::RetryPolicy;
use crate::types::{
    Claim, ClaimBatch, ClaimRequest, ClaimedJob, DEFAULT_MAX_RECLAIMS, Finalize, FinalizeOutcome,
    Lease, QueueName, RECLAIM_CAP_MESSAGE, RunAt,
};

/// How a [`Worker`] runs. Every field has a named default; [`WorkerConfig::validate`] refuses
/// combinations that would break the lease's guarantee.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Handlers running at once (default 8).
    pub concurrency: usize,
    /// Jobs claimed but not yet started that the worker may hold (default 0). Prefetch saves
    /// claim round trips for short jobs; a prefetched job's lease is already running, so a job
    /// whose remaining lease is shorter than `job_timeout` is released instead of started.
    pub prefetch: usize,
    /// The most jobs one claim asks for (default 100; the claim asks for fewer when fewer slots
    /// are free).
    pub max_batch: u32,
    /// How long an idle worker waits before polling again if no wake-up arrives (default 1 s).
    /// After a full batch it polls again at once.
    pub poll_interval: Duration,
    /// The claim lease (default [`Lease::DEFAULT`], 90 s). All workers of one queue should use
    /// the same lease: the claimer's lease decides when a job counts as abandoned.
    pub lease: Lease,
    /// A run longer than this is stopped and counts as a retryable handler error (default 30 s).
    /// Must be at most half the lease, unless the handler [`runs_long`](Handler::runs_long).
    pub job_timeout: Duration,
    /// A job whose lease expired after this many takeovers goes to `dead` (default
    /// [`DEFAULT_MAX_RECLAIMS`]).
    pub max_reclaims: u32,
    /// Retries of handler errors.
    pub retry: RetryPolicy,
    /// At shutdown, how long running jobs may take to finish before their cancellation tokens
    /// fire (default 20 s; with the 5 s grace that leaves 5 s of a 30 s termination grace period,
    /// such as Kubernetes' default, for the releases and the completer's last batch).
    pub shutdown_timeout: Duration,
    /// After the tokens fire, how long handlers get to return before they are aborted and their
    /// jobs released (default 5 s).
    pub shutdown_grace: Duration,
    /// Send outcomes of jobs without hooks through one batching completer (default true): many
    /// fenced writes per statement instead of one transaction per job.
    pub batch_finalize: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            concurrency: 8,
            prefetch: 0,
            max_batch: 100,
            poll_interval: Duration::from_secs(1),
            lease: Lease::DEFAULT,
            job_timeout: Duration::from_secs(30),
            max_reclaims: DEFAULT_MAX_RECLAIMS,
            retry: RetryPolicy::default(),
            shutdown_timeout: Duration::from_secs(20),
            shutdown_grace: Duration::from_secs(5),
            batch_finalize: true,
        }
    }
}

impl WorkerConfig {
    /// Checks the configuration for a handler that does (`runs_long`) or does not heartbeat.
    pub fn validate(&self, runs_long: bool) -> Result<(), ConfigError> {
        if self.concurrency == 0 {
            return Err(ConfigError::Zero("worker concurrency"));
        }
        if self.max_batch == 0 {
            return Err(ConfigError::Zero("worker max_batch"));
        }
        if self.poll_interval.is_zero() {
            return Err(ConfigError::Zero("worker poll_interval"));
        }
        if self.job_timeout.is_zero() {
            return Err(ConfigError::Zero("worker job_timeout"));
        }
        if !runs_long && self.lease.duration() < self.job_timeout * 2 {
            return Err(ConfigError::LeaseTooShortForTimeout {
                lease: self.lease.duration(),
                timeout: self.job_timeout,
            });
        }
        self.retry.validate()
    }
}

/// Counters of what a worker has done since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Jobs claimed.
    pub claimed: u64,
    /// Handler runs started.
    pub started: u64,
    /// Jobs completed (fenced write applied).
    pub completed: u64,
    /// Jobs scheduled for a retry (applied).
    pub retried: u64,
    /// Jobs failed terminally (applied).
    pub failed: u64,
    /// Jobs cancelled by their handler (applied).
    pub cancelled: u64,
    /// Claims released unstarted (applied).
    pub released: u64,
    /// Writes refused by the fence.
    pub stale: u64,
    /// Jobs buried (`dead`) at the reclaim cap (applied).
    pub dead: u64,
    /// Finalizes that failed for good (the job waits for its lease to lapse).
    pub finalize_errors: u64,
}

impl WorkerStats {
    /// Outcomes written or fenced: every claimed job ends up counted here exactly once (unless
    /// its finalize failed for good).
    pub fn finished(&self) -> u64 {
        self.completed
            + self.retried
            + self.failed
            + self.cancelled
            + self.released
            + self.stale
            + self.finalize_errors
    }

    fn record(&mut self, action: &Finalize, outcome: FinalizeOutcome) {
        if outcome == FinalizeOutcome::Stale {
            self.stale += 1;
            return;
        }
        match action {
            Finalize::Complete => self.completed += 1,
            Finalize::RetryAt { .. } => self.retried += 1,
            Finalize::FailTerminal { .. } => self.failed += 1,
            Finalize::Cancel { .. } => self.cancelled += 1,
            Finalize::Release => self.released += 1,
            Finalize::Bury { .. } => self.dead += 1,
        }
    }
}

/// What a graceful shutdown did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Claimed-but-unstarted jobs released with a fenced `release`.
    pub released_unstarted: u64,
    /// Running jobs that finished within the deadline.
    pub finished_in_time: u64,
    /// Running jobs aborted after the deadline and grace; released (fenced) so that nothing
    /// waits for a lease to lapse.
    pub aborted: u64,
    /// The worker's counters at the end, every outcome of the shutdown included.
    pub stats: WorkerStats,
}

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
    hooks: Hooks<B>,
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
    pub fn hook(mut self, hook: impl FinalizeHook<B>) -> Self {
        self.hooks.push(hook);
        self
    }

    /// Replaces the hooks.
    pub fn hooks(mut self, hooks: Hooks<B>) -> Self {
        self.hooks = hooks;
        self
    }

    /// Starts the worker on the current tokio runtime.
    pub fn start(self) -> WorkerHandle {
        let (stats_tx, stats_rx) = watch::channel(WorkerStats::default());
        let stop = CancellationToken::new();
        let (completer, completer_task) = if self.config.batch_finalize && self.hooks.is_empty() {
            let capacity =
                (self.config.concurrency + self.config.prefetch).max(COMPLETER_BATCH) * 2;
            let (tx, rx) = mpsc::channel(capacity);
            let done = CancellationToken::new();
            let task = tokio::spawn(run_completer(
                self.backend.clone(),
                rx,
                stats_tx.clone(),
                done.clone(),
            ));
            (Some(tx), Some((task, done)))
        } else {
            (None, None)
        };
        let shared = Arc::new(Shared {
            backend: self.backend,
            handler: self.handler,
            hooks: self.hooks,
            config: self.config,
            stats: stats_tx,
            completer,
        });
        let task = tokio::spawn(dispatch(shared, stop.clone(), completer_task));
        WorkerHandle {
            stop,
            task: Some(task),
            stats: stats_rx,
        }
    }
}

/// Controls a started worker. Dropping it asks the worker to shut down without waiting.
pub struct WorkerHandle {
    stop: CancellationToken,
    task: Option<JoinHandle<ShutdownReport>>,
    stats: watch::Receiver<WorkerStats>,
}

impl WorkerHandle {
    /// The counters so far.
    pub fn stats(&self) -> WorkerStats {
        *self.stats.borrow()
    }

    /// Waits until the counters satisfy `condition` (how tests and demos await progress without
    /// sleeping). Returns the counters that satisfied it.
    pub async fn wait_for(&self, condition: impl FnMut(&WorkerStats) -> bool) -> WorkerStats {
        let mut rx = self.stats.clone();
        *rx.wait_for(condition)
            .await
            .expect("the worker keeps its stats channel open until dropped")
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

struct Shared<B: Backend, H: Handler> {
    backend: B,
    handler: Arc<H>,
    hooks: Hooks<B>,
    config: WorkerConfig,
    stats: watch::Sender<WorkerStats>,
    completer: Option<mpsc::Sender<(Claim, Finalize)>>,
}

/// A claimed job waiting for a free slot, with when its lease started (locally measured, before
/// the claim was sent, so the estimate errs on the short side).
struct Buffered {
    job: ClaimedJob,
    lease_started: Instant,
}

struct Running {
    claim: Claim,
    cancel: CancellationToken,
}

/// A claim in flight: the dispatcher keeps starting buffered jobs while it runs.
type ClaimInFlight = Pin<Box<dyn Future<Output = (u32, Instant, Result<ClaimBatch>)> + Send>>;

/// A wake-up that never comes, for backends without one.
fn arm_wake(wake: &Option<Arc<Notify>>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    match wake {
        // An owned `Notified` receives `notify_waiters` from the moment it exists, so a
        // NOTIFY landing between an empty claim and the wait is not lost.
        Some(notify) => Box::pin(notify.clone().notified_owned()),
        None => Box::pin(std::future::pending()),
    }
}

async fn dispatch<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    stop: CancellationToken,
    completer_task: Option<(JoinHandle<()>, CancellationToken)>,
) -> ShutdownReport {
    let config = &shared.config;
    let wake = shared.backend.wake_signal();
    let mut buffer: VecDeque<Buffered> = VecDeque::new();
    let mut running: JoinSet<()> = JoinSet::new();
    let mut owners: HashMap<tokio::task::Id, Running> = HashMap::new();
    let slots = config.concurrency + config.prefetch;
    // Refill when at least half the slots (or half a batch) are free, or when idle: many small
    // claims cost a round trip and a commit each, one larger claim costs little more.
    let refill_at = (slots.min(config.max_batch as usize) / 2).max(1);

    let mut claiming: Option<ClaimInFlight> = None;
    // Whether work may be waiting: at start, after a full batch, a wake-up or a poll tick.
    let mut poll_due = true;
    let mut woken = arm_wake(&wake);
    let poll = tokio::time::sleep(config.poll_interval);
    tokio::pin!(poll);

    loop {
        start_buffered(&shared, &mut buffer, &mut running, &mut owners).await;
        if stop.is_cancelled() {
            break;
        }
        if claiming.is_none() && poll_due {
            let capacity = slots.saturating_sub(running.len() + buffer.len());
            let idle = running.is_empty() && buffer.is_empty();
            if capacity >= refill_at || (idle && capacity > 0) {
                let want = capacity.min(config.max_batch as usize) as u32;
                let request =
                    ClaimRequest::new(want, config.lease).max_reclaims(config.max_reclaims);
                let backend = shared.backend.clone();
                poll_due = false;
                claiming = Some(Box::pin(async move {
                    let lease_started = Instant::now();
                    (want, lease_started, backend.claim(request).await)
                }));
            }
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            (want, lease_started, result) = async { claiming.as_mut().expect("guarded").await },
                if claiming.is_some() =>
            {
                claiming = None;
                // A full batch means more work is likely waiting: claim again as soon as
                // there is room.
                poll_due = accept_claim(&shared, &mut buffer, want, lease_started, result);
            }
            Some(joined) = running.join_next_with_id(), if !running.is_empty() => {
                reap(&shared, joined, &mut owners);
            }
            _ = &mut woken => {
                woken = arm_wake(&wake);
                poll_due = true;
            }
            _ = &mut poll => {
                poll.as_mut().reset(Instant::now() + config.poll_interval);
                poll_due = true;
            }
        }
    }
    // A claim already sent may have taken jobs: receive them so shutdown releases them.
    if let Some(claim) = claiming.take() {
        let (want, lease_started, result) = claim.await;
        accept_claim(&shared, &mut buffer, want, lease_started, result);
    }

    let report = shut_down(&shared, buffer, running, owners).await;
    // Every job task has ended, so nothing more reaches the completer: let it flush and stop.
    if let Some((task, done)) = completer_task {
        done.cancel();
        let _ = task.await;
    }
    let report = ShutdownReport {
        stats: *shared.stats.borrow(),
        ..report
    };
    tracing::info!(
        name: "queue.worker_stopped",
        released_unstarted = report.released_unstarted,
        finished_in_time = report.finished_in_time,
        aborted = report.aborted,
        "queue.worker_stopped"
    );
    report
}

/// Buffers what a claim returned; true when it was a full batch.
fn accept_claim<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    buffer: &mut VecDeque<Buffered>,
    want: u32,
    lease_started: Instant,
    result: Result<ClaimBatch>,
) -> bool {
    let batch = match result {
        Ok(batch) => batch,
        Err(err) => {
            tracing::warn!(
                name: "queue.claim_failed",
                queue = %shared.backend.queue(),
                error = %err,
                transient = err.is_transient(),
                "queue.claim_failed"
            );
            return false;
        }
    };
    let got = batch.jobs.len() as u32;
    shared
        .stats
        .send_modify(|s| s.claimed += batch.jobs.len() as u64);
    for job in batch.jobs {
        if job.taken_over {
            tracing::info!(
                name: "queue.job_reclaimed",
                queue = %shared.backend.queue(),
                job_id = job.id.0,
                generation = job.generation.0,
                reclaims = job.reclaims,
                "queue.job_reclaimed"
            );
        }
        buffer.push_back(Buffered { job, lease_started });
    }
    got == want
}

/// Starts buffered jobs while slots are free; releases those whose lease is too far gone.
async fn start_buffered<B: Backend, H: Handler>(
    shared: &Arc<Shared<B, H>>,
    buffer: &mut VecDeque<Buffered>,
    running: &mut JoinSet<()>,
    owners: &mut HashMap<tokio::task::Id, Running>,
) {
    while running.len() < shared.config.concurrency {
        let Some(next) = buffer.pop_front() else {
            return;
        };
        let lease_left = shared
            .config
            .lease
            .duration()
            .saturating_sub(next.lease_started.elapsed());
        if !shared.handler.runs_long() && lease_left < shared.config.job_timeout {
            // Starting now could outlive the lease and race a second holder: give it back.
            let _ = release(shared, &next.job, "too little lease left to start").await;
            continue;
        }
        let cancel = CancellationToken::new();
        let claim = next.job.claim();
        let deadline = next.lease_started + shared.config.lease.duration();
        let task = running.spawn(run_job(shared.clone(), next.job, cancel.clone(), deadline));
        owners.insert(task.id(), Running { claim, cancel });
        shared.stats.send_modify(|s| s.started += 1);
    }
}

fn reap<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    joined: Result<(tokio::task::Id, ()), tokio::task::JoinError>,
    owners: &mut HashMap<tokio::task::Id, Running>,
) {
    let id = match &joined {
        Ok((id, ())) => *id,
        Err(err) => err.id(),
    };
    let owner = owners.remove(&id);
    if let (Err(err), Some(owner)) = (joined, owner) {
        // run_job catches handler panics itself; reaching here means the finalize path panicked.
        tracing::error!(
            name: "queue.finalize_failed",
            queue = %shared.backend.queue(),
            job_id = owner.claim.id.0,
            generation = owner.claim.generation.0,
            error = %err,
            "queue.finalize_failed: job task ended abnormally; the lease will lapse"
        );
    }
}

/// Gives a claimed job back unstarted (fenced); true when the release applied.
async fn release<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    job: &ClaimedJob,
    why: &str,
) -> bool {
    tracing::info!(
        name: "queue.claim_released",
        queue = %shared.backend.queue(),
        job_id = job.id.0,
        generation = job.generation.0,
        reason = why,
        "queue.claim_released"
    );
    finalize_now(shared, job, Finalize::Release).await
}

async fn shut_down<B: Backend, H: Handler>(
    shared: &Arc<Shared<B, H>>,
    buffer: VecDeque<Buffered>,
    mut running: JoinSet<()>,
    mut owners: HashMap<tokio::task::Id, Running>,
) -> ShutdownReport {
    let mut report = ShutdownReport::default();
    for unstarted in buffer {
        if release(shared, &unstarted.job, "shutdown").await {
            report.released_unstarted += 1;
        }
    }

    let deadline = Instant::now() + shared.config.shutdown_timeout;
    while let Ok(Some(joined)) =
        tokio::time::timeout_at(deadline, running.join_next_with_id()).await
    {
        reap(shared, joined, &mut owners);
        report.finished_in_time += 1;
    }
    if running.is_empty() {
        return report;
    }

    // Deadline passed: ask the handlers to stop, give them a grace period, then abort.
    for owner in owners.values() {
        owner.cancel.cancel();
    }
    let grace = Instant::now() + shared.config.shutdown_grace;
    while let Ok(Some(joined)) = tokio::time::timeout_at(grace, running.join_next_with_id()).await {
        reap(shared, joined, &mut owners);
        report.finished_in_time += 1;
    }
    running.abort_all();
    while let Some(joined) = running.join_next_with_id().await {
        let id = match &joined {
            Ok((id, ())) => *id,
            Err(err) => err.id(),
        };
        if let Some(owner) = owners.remove(&id) {
            if joined.is_err() {
                // Aborted mid-run: give the job back now rather than after a full lease. (No
                // hooks: they need the claimed job, which is not kept per running task, and a
                // release ends nothing for them to record.)
                tracing::info!(
                    name: "queue.claim_released",
                    queue = %shared.backend.queue(),
                    job_id = owner.claim.id.0,
                    generation = owner.claim.generation.0,
                    reason = "aborted at the shutdown deadline",
                    "queue.claim_released"
                );
                let outcome = shared
                    .backend
                    .finalize(owner.claim, &Finalize::Release)
                    .await;
                record_outcome(shared, owner.claim, &Finalize::Release, outcome);
                report.aborted += 1;
            } else {
                report.finished_in_time += 1;
            }
        }
    }
    report
}

/// Runs one job: decode, handle (with timeout, panic capture and heartbeat), decide, finalize.
async fn run_job<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    job: ClaimedJob,
    cancel: CancellationToken,
    lease_deadline: Instant,
) {
    let span = tracing::info_span!(
        "queue.job",
        queue = %shared.backend.queue(),
        job_id = job.id.0,
        attempt = job.attempts,
        generation = job.generation.0,
    );
    async move {
        if job.over_reclaim_cap {
            // A poison job: its worker kept dying. Do not run it again; bury it, fenced and with
            // the hooks, like any other terminal outcome.
            let bury = Finalize::Bury {
                reason: RECLAIM_CAP_MESSAGE.to_owned(),
            };
            finalize(&shared, &job, bury).await;
            return;
        }
        let action = match serde::Deserialize::deserialize(&job.payload) {
            Err(err) => {
                tracing::error!(
                    name: "queue.payload_malformed",
                    error = %err,
                    "queue.payload_malformed: failing the job terminally; its payload stays in the row"
                );
                Finalize::FailTerminal {
                    error: format!("malformed payload: {err}"),
                }
            }
            Ok(payload) => {
                let result = run_handler(&shared, &job, payload, cancel, lease_deadline).await;
                decide(&shared.config.retry, &job, result)
            }
        };
        finalize(&shared, &job, action).await;
    }
    .instrument(span)
    .await
}

/// Aborts the wrapped task when dropped, so an aborted job task takes its handler down with it.
struct AbortOnDrop<T>(JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn run_handler<B: Backend, H: Handler>(
    shared: &Arc<Shared<B, H>>,
    job: &ClaimedJob,
    payload: H::Payload,
    cancel: CancellationToken,
    lease_deadline: Instant,
) -> Result<(), JobError> {
    let mut ctx = JobContext::new(shared.backend.queue().clone(), job, cancel.clone());
    if !shared.handler.runs_long() {
        ctx = ctx.with_lease_deadline(lease_deadline);
    }
    // Caught in place rather than in a task of its own: a panic becomes a retryable error
    // without a spawn per job.
    let run = CatchUnwind(Box::pin(shared.handler.handle(ctx, payload)));
    let _heartbeat = shared
        .handler
        .runs_long()
        .then(|| AbortOnDrop(tokio::spawn(heartbeat(shared.clone(), job.claim(), cancel))));
    let timeout = shared.config.job_timeout;
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(result)) => result,
        Ok(Err(panic)) => {
            let message = panic_message(&panic);
            tracing::error!(name: "queue.handler_panicked", error = %message, "queue.handler_panicked");
            Err(JobError::retry(format!("handler panicked: {message}")))
        }
        Err(_) => {
            tracing::warn!(name: "queue.handler_timed_out", timeout_ms = timeout.as_millis() as u64, "queue.handler_timed_out");
            Err(JobError::retry(format!(
                "handler timed out after {timeout:?}"
            )))
        }
    }
}

/// Polls a future, turning a panic inside it into an error.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(output)) => std::task::Poll::Ready(Ok(output)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".to_owned())
}

/// Extends the lease every third of it; a stale heartbeat means the lease is lost: cancel.
async fn heartbeat<B: Backend, H: Handler>(
    shared: Arc<Shared<B, H>>,
    claim: Claim,
    cancel: CancellationToken,
) {
    let every = shared.config.lease.duration() / 3;
    loop {
        tokio::time::sleep(every).await;
        match shared.backend.extend_lease(claim).await {
            Ok(FinalizeOutcome::Applied) => {}
            Ok(FinalizeOutcome::Stale) => {
                tracing::warn!(
                    name: "queue.lease_lost",
                    job_id = claim.id.0,
                    generation = claim.generation.0,
                    "queue.lease_lost: another worker holds the job now; cancelling the handler"
                );
                cancel.cancel();
                return;
            }
            // A failed heartbeat is retried at the next tick; the lease has slack for two misses.
            Err(err) => tracing::warn!(
                name: "queue.heartbeat_failed",
                job_id = claim.id.0,
                error = %err,
                "queue.heartbeat_failed: tried again at the next tick"
            ),
        }
    }
}

/// Turns a handler result into the fenced write to make.
fn decide(policy: &RetryPolicy, job: &ClaimedJob, result: Result<(), JobError>) -> Finalize {
    let err = match result {
        Ok(()) => return Finalize::Complete,
        Err(err) => err,
    };
    let previous = job.handler_errors();
    let error = err.to_string();
    match err.action() {
        ErrorAction::Fatal => Finalize::FailTerminal { error },
        ErrorAction::Cancel => Finalize::Cancel { reason: error },
        ErrorAction::Release => Finalize::Release,
        ErrorAction::Retry | ErrorAction::RetryAfter(_) if policy.gives_up_after(previous) => {
            Finalize::FailTerminal {
                error: format!(
                    "{error} (gave up after {} failing runs)",
                    previous.saturating_add(1)
                ),
            }
        }
        ErrorAction::Retry => Finalize::RetryAt {
            at: RunAt::After(policy.backoff(previous)),
            error,
        },
        ErrorAction::RetryAfter(delay) => Finalize::RetryAt {
            at: RunAt::After(delay),
            error,
        },
    }
}

/// Writes a job's outcome: through the batching completer when there are no hooks, otherwise in
/// its own transaction with the hooks ([`finalize_now`]).
async fn finalize<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    job: &ClaimedJob,
    action: Finalize,
) {
    if let Some(completer) = &shared.completer
        && completer.send((job.claim(), action.clone())).await.is_ok()
    {
        return;
    }
    finalize_now(shared, job, action).await;
}

/// Writes a job's outcome now, hooks included. A failure (of the database or of a hook) is
/// tried again three times with growing pauses, whatever its kind: the fence makes a late
/// attempt harmless, and a job whose finalize keeps failing waits for its lease to lapse.
/// Returns whether the write applied.
async fn finalize_now<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    job: &ClaimedJob,
    action: Finalize,
) -> bool {
    const DELAYS: [Duration; 3] = [
        Duration::from_millis(50),
        Duration::from_millis(250),
        Duration::from_secs(1),
    ];
    let mut attempt = 0;
    loop {
        let result = if shared.hooks.is_empty() {
            shared.backend.finalize(job.claim(), &action).await
        } else {
            finalize_with_hooks(&shared.backend, &shared.hooks, job, &action).await
        };
        match result {
            Err(err) if attempt < DELAYS.len() => {
                tracing::warn!(
                    name: "queue.finalize_retry",
                    action = action.kind(),
                    error = %err,
                    "queue.finalize_retry"
                );
                tokio::time::sleep(DELAYS[attempt]).await;
                attempt += 1;
            }
            result => {
                // finalize_with_hooks already logged a stale fence; log the hookless one here.
                if shared.hooks.is_empty() && matches!(result, Ok(FinalizeOutcome::Stale)) {
                    events::stale_finalize_fenced(shared.backend.queue(), job.claim(), &action);
                }
                let applied = matches!(result, Ok(FinalizeOutcome::Applied));
                if applied {
                    log_applied(shared.backend.queue(), job.claim(), &action);
                }
                record_outcome(shared, job.claim(), &action, result);
                return applied;
            }
        }
    }
}

/// The events of outcomes that an operator may want to see or alert on.
fn log_applied(queue: &QueueName, claim: Claim, action: &Finalize) {
    match action {
        Finalize::RetryAt { error, .. } => tracing::info!(
            name: "queue.job_retry_scheduled",
            queue = %queue,
            job_id = claim.id.0,
            error = %error,
            "queue.job_retry_scheduled"
        ),
        Finalize::FailTerminal { error } => tracing::warn!(
            name: "queue.job_failed",
            queue = %queue,
            job_id = claim.id.0,
            error = %error,
            "queue.job_failed"
        ),
        Finalize::Bury { .. } => events::job_dead(queue, claim.id),
        _ => {}
    }
}

fn record_outcome<B: Backend, H: Handler>(
    shared: &Shared<B, H>,
    claim: Claim,
    action: &Finalize,
    result: Result<FinalizeOutcome>,
) {
    match result {
        Ok(outcome) => shared.stats.send_modify(|s| s.record(action, outcome)),
        Err(err) => {
            tracing::error!(
                name: "queue.finalize_failed",
                queue = %shared.backend.queue(),
                job_id = claim.id.0,
                generation = claim.generation.0,
                action = action.kind(),
                error = %err,
                "queue.finalize_failed: the job stays in flight until its lease lapses"
            );
            shared.stats.send_modify(|s| s.finalize_errors += 1);
        }
    }
}

/// The most outcomes one batched finalize writes.
const COMPLETER_BATCH: usize = 512;

/// Collects outcomes of hookless jobs and writes them in batches: each job is still fenced on
/// its own generation, one outcome per job.
async fn run_completer<B: Backend>(
    backend: B,
    mut rx: mpsc::Receiver<(Claim, Finalize)>,
    stats: watch::Sender<WorkerStats>,
    done: CancellationToken,
) {
    let mut batch = Vec::with_capacity(COMPLETER_BATCH);
    loop {
        tokio::select! {
            biased;
            _ = rx.recv_many(&mut batch, COMPLETER_BATCH) => {}
            _ = done.cancelled() => {
                while batch.len() < COMPLETER_BATCH {
                    match rx.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
            }
        }
        if batch.is_empty() {
            return;
        }
        let mut attempt = 0u32;
        let outcomes = loop {
            match backend.finalize_many(&batch).await {
                Ok(outcomes) => break Ok(outcomes),
                Err(err) if attempt < 3 => {
                    tracing::warn!(name: "queue.finalize_retry", error = %err, batch = batch.len(), "queue.finalize_retry");
                    tokio::time::sleep(Duration::from_millis(50 << (2 * attempt))).await;
                    attempt += 1;
                }
                Err(err) => break Err(err),
            }
        };
        match outcomes {
            Ok(outcomes) => {
                for ((claim, action), outcome) in batch.iter().zip(&outcomes) {
                    match outcome {
                        FinalizeOutcome::Stale => {
                            events::stale_finalize_fenced(backend.queue(), *claim, action)
                        }
                        FinalizeOutcome::Applied => log_applied(backend.queue(), *claim, action),
                    }
                }
                stats.send_modify(|s| {
                    for ((_, action), outcome) in batch.iter().zip(&outcomes) {
                        s.record(action, *outcome);
                    }
                });
            }
            Err(err) => {
                tracing::error!(
                    name: "queue.finalize_failed",
                    queue = %backend.queue(),
                    batch = batch.len(),
                    error = %err,
                    "queue.finalize_failed: these jobs stay in flight until their leases lapse"
                );
                stats.send_modify(|s| s.finalize_errors += batch.len() as u64);
            }
        }
        batch.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ClaimGeneration, JobId};

    fn job(attempts: i32, reclaims: i32) -> ClaimedJob {
        ClaimedJob {
            id: JobId(1),
            generation: ClaimGeneration(attempts as i64),
            attempts,
            reclaims,
            taken_over: false,
            over_reclaim_cap: false,
            claimed_at: chrono::Utc::now(),
            priority: 0,
            payload: serde_json::Value::Null,
        }
    }

    #[test]
    fn config_refuses_a_lease_under_twice_the_timeout() {
        let config = WorkerConfig {
            lease: Lease::from_secs(50).unwrap(),
            job_timeout: Duration::from_secs(30),
            ..WorkerConfig::default()
        };
        let err = config.validate(false).unwrap_err();
        assert!(matches!(err, ConfigError::LeaseTooShortForTimeout { .. }));
        assert!(err.to_string().contains("at least twice"), "{err}");
        // A heartbeating handler may run past the lease.
        assert!(config.validate(true).is_ok());
        assert!(WorkerConfig::default().validate(false).is_ok());
        let zero = WorkerConfig {
            concurrency: 0,
            ..WorkerConfig::default()
        };
        assert_eq!(
            zero.validate(false),
            Err(ConfigError::Zero("worker concurrency"))
        );
    }

    #[test]
    fn decide_maps_intents_and_counts_handler_errors_only() {
        let policy = RetryPolicy {
            max_attempts: 3,
            jitter: false,
            ..RetryPolicy::default()
        };
        assert_eq!(decide(&policy, &job(1, 0), Ok(())), Finalize::Complete);
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::retry("x"))),
            Finalize::RetryAt {
                at: RunAt::After(d),
                ..
            } if d == Duration::from_secs(1)
        ));
        // Third failing run (two earlier errors) gives up.
        assert!(matches!(
            decide(&policy, &job(3, 0), Err(JobError::retry("x"))),
            Finalize::FailTerminal { error } if error.contains("gave up after 3")
        ));
        // Same attempts, but two of them were lease takeovers: only one handler error so far.
        assert!(matches!(
            decide(&policy, &job(4, 2), Err(JobError::retry("x"))),
            Finalize::RetryAt { .. }
        ));
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::fatal("no"))),
            Finalize::FailTerminal { error } if error == "no"
        ));
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::cancel("moot"))),
            Finalize::Cancel { .. }
        ));
        assert_eq!(
            decide(&policy, &job(9, 0), Err(JobError::release("no lease left"))),
            Finalize::Release
        );
        assert!(matches!(
            decide(&policy, &job(1, 0), Err(JobError::retry_after(Duration::from_secs(7), "later"))),
            Finalize::RetryAt { at: RunAt::After(d), .. } if d == Duration::from_secs(7)
        ));
    }
}
