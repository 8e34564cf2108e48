//! The one place a worker writes a job's outcome: fenced, with the hooks when there are any, in
//! batches when there are none, every outcome counted and reported through [`events`].
//!
//! One retry schedule for every write ([`Backoff`]: 50 ms doubling to 5 s, with jitter), tried
//! until the job's lease deadline, after which the lease decides. What cannot heal by retrying
//! is not retried: a batch the database refuses is split until the bad item stands alone; a
//! hook that keeps failing until the lease is nearly over gets the job ended `dead` without the
//! hooks, so that no job is left in flight forever. A write whose commit result was lost and
//! that then finds the job gone is checked, and reported as applied or as unknown, never as
//! another worker's fence.
//!
//! Where the backend fuses them ([`Backend::fuses_claims`]), the batching task also sends the
//! dispatcher's claims, each with the outcomes waiting: one statement per batch writes batch k
//! and claims batch k+1.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::stats::WorkerStats;
use crate::backend::Backend;
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::events;
use crate::hooks::{Hooks, finalize_batch, finalize_once};
use crate::metrics::QueueMetrics;
use crate::types::{
    Claim, ClaimBatch, ClaimRequest, ClaimedJob, Finalize, FinalizeOutcome, JobStatus,
};

/// The first pause before a failed write is tried again; pauses double from here.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
/// The longest pause between two tries of a write.
const LONGEST_PAUSE: Duration = Duration::from_secs(5);
/// A failing hook is tried at least this often before the job is ended without it.
const HOOK_TRIES: u32 = 3;
/// The most outcomes one batched write carries.
const BATCH_LIMIT: usize = 512;
/// The most outcomes with hooks one transaction carries: each is a savepoint, and PostgreSQL
/// keeps up to 64 subtransactions of a transaction in shared memory before other sessions'
/// snapshots get slower.
const HOOKED_BATCH_LIMIT: usize = 50;
/// The most transactions of outcomes with hooks one worker writes at once: each job's writes
/// are several round trips, so one transaction at a time would bound a worker by its latency.
const HOOKED_WRITERS: usize = 4;
/// How long outcomes wait for the dispatcher's next claim to carry them, when claims carry
/// outcomes: a busy dispatcher claims as soon as half its slots are free, which the outcomes
/// of those slots come just before.
const LINGER: Duration = Duration::from_millis(5);

/// A claim the dispatcher hands to the batching task, which sends it with the outcomes
/// waiting and answers on `reply`.
struct ClaimAsk {
    request: ClaimRequest,
    reply: oneshot::Sender<Result<ClaimBatch>>,
}

/// An outcome to write, with the local estimate of when its job's lease ends.
struct Outcome {
    claim: Claim,
    action: Finalize,
    deadline: Instant,
}

/// An outcome whose hooks must run, with its job (the hooks read it), and its place among the
/// outcomes outstanding (given back when it is dropped).
struct HookedOutcome {
    job: ClaimedJob,
    action: Finalize,
    deadline: Instant,
    _place: OwnedSemaphorePermit,
}

/// The outcomes with hooks handed to the batching task and not yet reported. Bounded: while
/// as many wait as the worker has slots, a finishing job keeps its slot until a place frees,
/// so outcomes that keep failing cannot make the worker claim without end (it holds at most
/// twice its slots). Those still
/// unwritten when shutdown's time runs out are given back (released) instead of waiting for
/// their leases.
struct Outstanding {
    places: Arc<Semaphore>,
    claims: Mutex<HashSet<Claim>>,
}

impl Outstanding {
    fn done(&self, claim: Claim) {
        self.claims.lock().expect("not poisoned").remove(&claim);
    }
}

/// What a batching task gives back when shutdown's time runs out.
type Release = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// How much of shutdown's last moment is kept to give back outcomes still unwritten.
const RELEASE_MARGIN: Duration = Duration::from_millis(500);

/// What became of a write.
enum Written {
    /// The fence applied it, or refused it.
    Done(FinalizeOutcome),
    /// Its commit result was lost and the job has moved on since: it may or may not have been
    /// written.
    Unknown,
    /// It failed for good; the job waits for its lease to lapse.
    Failed(Error),
}

/// Writes outcomes for one worker.
pub(super) struct Finalizer<B: Backend, P> {
    writer: Arc<Writer<B>>,
    hooked: Arc<Hooked<B, P>>,
    /// Where outcomes go to be written in batches; `None` when there are hooks or batching is
    /// off.
    batch: Option<mpsc::Sender<Outcome>>,
    /// Where outcomes with hooks go to be written many to a transaction; `None` without hooks,
    /// with batching off, or on a backend without savepoints.
    hooked_batch: Option<(mpsc::Sender<HookedOutcome>, Arc<Outstanding>)>,
    /// Where claims go to carry the batched outcomes; `None` unless the backend fuses them.
    claims: Option<mpsc::Sender<ClaimAsk>>,
}

/// The batching task, stopped once no job can send to it any more.
pub(super) struct BatchTask {
    task: JoinHandle<()>,
    done: CancellationToken,
    release: Option<Release>,
}

impl BatchTask {
    /// Lets the task write what it holds and waits for it to end, at most until `deadline`;
    /// gives back what it could not write by then, where it keeps track of that.
    pub(super) async fn finish(self, deadline: Instant) {
        self.done.cancel();
        let abort = self.task.abort_handle();
        let margin = match self.release {
            Some(_) => RELEASE_MARGIN.min(deadline.saturating_duration_since(Instant::now()) / 2),
            None => Duration::ZERO,
        };
        if tokio::time::timeout_at(deadline - margin, self.task)
            .await
            .is_err()
        {
            abort.abort();
        }
        if let Some(release) = self.release {
            let _ = tokio::time::timeout_at(deadline, release()).await;
        }
    }
}

impl<B, P> Finalizer<B, P>
where
    B: Backend,
    P: DeserializeOwned + Send + Sync + 'static,
{
    /// A finalizer for jobs held under `lease`. With `batch` it also starts a batching task,
    /// whose queue holds `capacity` outcomes: without hooks the one that writes outcomes in
    /// batches (and also sends the claims when `fuse` asks for it and the backend can), with
    /// hooks on a backend with savepoints the one that writes them many to a transaction.
    pub(super) fn start(
        backend: B,
        hooks: Hooks<B::Tx, P>,
        (stats, metrics): (watch::Sender<WorkerStats>, QueueMetrics),
        lease: Duration,
        (batch, fuse, capacity): (bool, bool, usize),
    ) -> (Self, Option<BatchTask>) {
        let fuse = fuse && backend.fuses_claims();
        let writer = Arc::new(Writer {
            backend,
            stats,
            metrics,
            lease,
        });
        let hooked = Arc::new(Hooked {
            writer: writer.clone(),
            hooks,
        });
        let mut finalizer = Finalizer {
            writer,
            hooked,
            batch: None,
            hooked_batch: None,
            claims: None,
        };
        let task = if !batch {
            None
        } else if finalizer.hooked.hooks.is_empty() {
            Some(finalizer.start_batcher(capacity, fuse))
        } else if finalizer.writer.backend.savepoints() {
            Some(finalizer.start_hooked_batcher(capacity))
        } else {
            None
        };
        (finalizer, task)
    }

    /// Starts the task that writes outcomes without hooks in batches, and sends the claims
    /// with the outcomes waiting when `fuse`.
    fn start_batcher(&mut self, capacity: usize, fuse: bool) -> BatchTask {
        let (tx, rx) = mpsc::channel(capacity.max(BATCH_LIMIT) * 2);
        let asks = fuse.then(|| {
            let (claims, asks) = mpsc::channel(1);
            self.claims = Some(claims);
            asks
        });
        let done = CancellationToken::new();
        let batcher = Batcher {
            writer: self.writer.clone(),
            rx,
            asks,
            done: done.clone(),
        };
        let task = tokio::spawn(batcher.run());
        self.batch = Some(tx);
        BatchTask {
            task,
            done,
            release: None,
        }
    }

    /// Starts the task that writes outcomes with hooks many to a transaction, a savepoint
    /// each; what it still holds when shutdown's time runs out is given back.
    fn start_hooked_batcher(&mut self, capacity: usize) -> BatchTask {
        let (tx, rx) = mpsc::channel(capacity.max(HOOKED_BATCH_LIMIT) * 2);
        let outstanding = Arc::new(Outstanding {
            places: Arc::new(Semaphore::new(capacity.max(1))),
            claims: Mutex::new(HashSet::new()),
        });
        let done = CancellationToken::new();
        let batcher = HookedBatcher {
            hooked: self.hooked.clone(),
            outstanding: outstanding.clone(),
            rx,
            done: done.clone(),
            alone: JoinSet::new(),
        };
        let task = tokio::spawn(batcher.run());
        let release = Some(release_unwritten(self.writer.clone(), outstanding.clone()));
        self.hooked_batch = Some((tx, outstanding));
        BatchTask {
            task,
            done,
            release,
        }
    }

    /// Claims jobs: through the batching task, with the outcomes waiting, when claims carry
    /// outcomes; straight from the backend otherwise (and if that task is gone).
    pub(super) async fn claim(&self, request: ClaimRequest) -> Result<ClaimBatch> {
        if let Some(claims) = &self.claims {
            let (reply, answer) = oneshot::channel();
            let ask = ClaimAsk {
                request: request.clone(),
                reply,
            };
            if claims.send(ask).await.is_ok()
                && let Ok(claimed) = answer.await
            {
                return claimed;
            }
        }
        self.writer.backend.claim(request).await
    }

    /// Writes a job's outcome: handed to the batching task when there is one, written now
    /// otherwise. `deadline` is when the job's lease ends by the local clock.
    pub(super) async fn finish(&self, job: &ClaimedJob, action: Finalize, deadline: Instant) {
        if let Some((batch, outstanding)) = &self.hooked_batch {
            let Ok(place) = outstanding.places.clone().acquire_owned().await else {
                self.finish_now(job, action, deadline).await;
                return;
            };
            let outcome = HookedOutcome {
                job: job.clone(),
                action,
                deadline,
                _place: place,
            };
            outstanding
                .claims
                .lock()
                .expect("not poisoned")
                .insert(job.claim());
            match batch.send(outcome).await {
                Ok(()) => return,
                Err(refused) => {
                    outstanding.done(job.claim());
                    let HookedOutcome { action, .. } = refused.0;
                    self.finish_now(job, action, deadline).await;
                    return;
                }
            }
        }
        if let Some(batch) = &self.batch {
            let outcome = Outcome {
                claim: job.claim(),
                action,
                deadline,
            };
            match batch.send(outcome).await {
                Ok(()) => return,
                Err(refused) => {
                    let Outcome { action, .. } = refused.0;
                    self.finish_now(job, action, deadline).await;
                    return;
                }
            }
        }
        self.finish_now(job, action, deadline).await;
    }

    /// Writes a job's outcome now, hooks included; true when the write applied.
    pub(super) async fn finish_now(
        &self,
        job: &ClaimedJob,
        action: Finalize,
        deadline: Instant,
    ) -> bool {
        self.hooked
            .finish_now(job, action, deadline, Tried::default())
            .await
    }

    /// Gives a claimed job back unstarted (fenced); true when the release applied.
    pub(super) async fn release(&self, job: &ClaimedJob, reason: &str, deadline: Instant) -> bool {
        events::claim_released(self.writer.backend.queue(), job.claim(), reason);
        self.finish_now(job, Finalize::Release, deadline).await
    }

    /// Gives back the jobs whose tasks were aborted at the shutdown deadline: one batched,
    /// fenced write, tried once and without hooks (a release ends nothing for them to record),
    /// so that shutdown keeps its deadline. A job whose release fails waits for its lease.
    pub(super) async fn release_aborted(&self, jobs: &[Arc<ClaimedJob>]) {
        if jobs.is_empty() {
            return;
        }
        let queue = self.writer.backend.queue();
        let outcomes: Vec<Outcome> = jobs
            .iter()
            .map(|job| {
                events::claim_released(queue, job.claim(), "aborted at the shutdown deadline");
                Outcome {
                    claim: job.claim(),
                    action: Finalize::Release,
                    deadline: Instant::now(),
                }
            })
            .collect();
        self.writer.write_batch(outcomes, false).await;
    }
}

/// What an earlier try of a write with hooks left: whether it may have committed (a lost
/// reply), and how often a hook failed.
#[derive(Debug, Clone, Copy, Default)]
struct Tried {
    maybe_written: bool,
    hook_failures: u32,
}

/// Writes outcomes with the hooks, one job at a time: shared by the finalizer and its batching
/// task for jobs with hooks (which sends here what its batch could not write).
struct Hooked<B: Backend, P> {
    writer: Arc<Writer<B>>,
    hooks: Hooks<B::Tx, P>,
}

impl<B, P> Hooked<B, P>
where
    B: Backend,
    P: DeserializeOwned + Send + Sync + 'static,
{
    /// Writes a job's outcome with the hooks now and reports it; true when the write applied.
    async fn finish_now(
        &self,
        job: &ClaimedJob,
        action: Finalize,
        deadline: Instant,
        tried: Tried,
    ) -> bool {
        let (action, written) = self.write_with_hooks(job, action, deadline, tried).await;
        let applied = matches!(written, Written::Done(FinalizeOutcome::Applied));
        self.writer.report(job.claim(), &action, &written);
        applied
    }

    /// The write of one outcome with the hooks, tried again on the schedule until `deadline`.
    /// Returns the write that was made (a hook that kept failing turns it into `Dead`).
    async fn write_with_hooks(
        &self,
        job: &ClaimedJob,
        action: Finalize,
        deadline: Instant,
        tried: Tried,
    ) -> (Finalize, Written) {
        let writer = &self.writer;
        let queue = writer.backend.queue();
        let mut backoff = Backoff::new(FIRST_PAUSE, LONGEST_PAUSE);
        let Tried {
            mut maybe_written,
            mut hook_failures,
        } = tried;
        loop {
            let sent = Instant::now();
            let result = finalize_once(&writer.backend, &self.hooks, job, &action).await;
            writer.metrics.finalize(sent.elapsed());
            let err = match result {
                Ok(FinalizeOutcome::Stale) if maybe_written => {
                    let written = writer.confirm(job.claim(), &action).await;
                    return (action, written);
                }
                Ok(outcome) => return (action, Written::Done(outcome)),
                Err(err) => err,
            };
            let failing_hook = match &err {
                Error::Hook { hook, .. } => Some(hook.clone()),
                _ => None,
            };
            if failing_hook.is_none() && !err.is_transient() {
                return (action, Written::Failed(err));
            }
            // A hook error rolled everything back; a lost connection may have committed.
            maybe_written |= failing_hook.is_none();
            hook_failures += u32::from(failing_hook.is_some());
            if failing_hook.is_some() {
                writer.metrics.hook_failed();
            }
            let until = match failing_hook {
                Some(_) if hook_failures < HOOK_TRIES => Instant::now() + LONGEST_PAUSE * 2,
                Some(_) => deadline.checked_sub(writer.lease / 10).unwrap_or(deadline),
                None => deadline,
            };
            match backoff.pause_before(until) {
                Some(pause) => {
                    events::finalize_retry(queue, 1, &err, pause);
                    tokio::time::sleep(pause).await;
                }
                None => match failing_hook {
                    Some(hook) => {
                        return writer
                            .end_dead(job.claim(), &action, &hook, &err, deadline)
                            .await;
                    }
                    None => return (action, Written::Failed(err)),
                },
            }
        }
    }
}

/// Writes outcomes without hooks and reports them: shared by the finalizer and its batching
/// task.
struct Writer<B> {
    backend: B,
    stats: watch::Sender<WorkerStats>,
    metrics: QueueMetrics,
    lease: Duration,
}

impl<B: Backend> Writer<B> {
    /// A write whose commit result was lost found the job gone: it is ours if the job shows
    /// our generation and token and the status our write leaves; otherwise nobody can tell
    /// (after a failover that reissued our generation, the row another holder ended shows its
    /// token, not ours).
    async fn confirm(&self, claim: Claim, action: &Finalize) -> Written {
        match self.backend.get(claim.id).await {
            Ok(Some(row))
                if row.claim_generation == claim.generation
                    && row.claim_token == claim.token
                    && row.status == action.target_status()
                    && row.status != JobStatus::InFlight =>
            {
                Written::Done(FinalizeOutcome::Applied)
            }
            _ => Written::Unknown,
        }
    }

    /// Ends a job `dead` without the hooks, because `hook` kept failing (`error`) until the
    /// lease was nearly over: the job must reach a terminal state; the domain side is left to
    /// the operator (the event and `last_error` name the hook).
    async fn end_dead(
        &self,
        claim: Claim,
        wanted: &Finalize,
        hook: &str,
        error: &Error,
        deadline: Instant,
    ) -> (Finalize, Written) {
        events::hook_gave_up(self.backend.queue(), claim, wanted, hook, error);
        let dead = Finalize::Dead {
            reason: format!(
                "finalize hook `{hook}` kept failing on outcome `{}`; ended dead without the \
                 hooks: {error}",
                wanted.kind()
            ),
        };
        let outcome = Outcome {
            claim,
            action: dead,
            deadline: deadline.max(Instant::now() + LONGEST_PAUSE * 2),
        };
        let written = match self.write_many(std::slice::from_ref(&outcome), false).await {
            Ok(mut written) => written.remove(0),
            Err((err, _)) => Written::Failed(err),
        };
        (outcome.action, written)
    }

    /// Writes `outcomes` in one batch, tried again on the schedule while the error is transient
    /// and the latest deadline allows; a batch the database refuses is split in halves until
    /// the refused item stands alone. `maybe_written`: an earlier try may have committed.
    async fn write_batch(&self, outcomes: Vec<Outcome>, maybe_written: bool) {
        // Each batch with whether an earlier try of it may have committed (a lost reply): its
        // halves inherit that, so a refusal after a lost reply is still checked, never Stale.
        let mut todo = vec![(outcomes, maybe_written)];
        while let Some((batch, maybe_written)) = todo.pop() {
            match self.write_many(&batch, maybe_written).await {
                Ok(written) => self.report_all(&batch, written),
                Err((err, maybe_written)) if !err.is_transient() && batch.len() > 1 => {
                    let mut first = batch;
                    let second = first.split_off(first.len() / 2);
                    todo.push((second, maybe_written));
                    todo.push((first, maybe_written));
                }
                Err((err, _)) => {
                    let claim = (batch.len() == 1).then(|| batch[0].claim);
                    events::finalize_failed(self.backend.queue(), claim, batch.len(), &err);
                    self.metrics.finalize_failed(batch.len() as u64);
                    self.stats
                        .send_modify(|s| s.finalize_errors += batch.len() as u64);
                }
            }
        }
    }

    async fn write_many(
        &self,
        batch: &[Outcome],
        mut maybe_written: bool,
    ) -> Result<Vec<Written>, (Error, bool)> {
        let queue = self.backend.queue();
        let items: Vec<(Claim, Finalize)> =
            batch.iter().map(|o| (o.claim, o.action.clone())).collect();
        let deadline = batch
            .iter()
            .map(|o| o.deadline)
            .max()
            .unwrap_or_else(Instant::now);
        let mut backoff = Backoff::new(FIRST_PAUSE, LONGEST_PAUSE);
        loop {
            let sent = Instant::now();
            let result = self.backend.finalize_many(&items).await;
            self.metrics.finalize(sent.elapsed());
            match result {
                Ok(outcomes) => {
                    let mut written = Vec::with_capacity(outcomes.len());
                    for ((claim, action), outcome) in items.iter().zip(outcomes) {
                        written.push(match outcome {
                            FinalizeOutcome::Stale if maybe_written => {
                                self.confirm(*claim, action).await
                            }
                            outcome => Written::Done(outcome),
                        });
                    }
                    return Ok(written);
                }
                Err(err) if !err.is_transient() => return Err((err, maybe_written)),
                Err(err) => {
                    maybe_written = true;
                    let Some(pause) = backoff.pause_before(deadline) else {
                        return Err((err, maybe_written));
                    };
                    events::finalize_retry(queue, items.len(), &err, pause);
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Writes `batch` and claims for `ask` in one statement, and answers the claim. When that
    /// fails, the claim is sent again alone at once (a bad outcome or a lost reply must not
    /// hold up the dispatcher), then the outcomes are written as after a lost reply. Jobs
    /// claimed for a dispatcher that stopped waiting are released.
    async fn write_with_claim(&self, batch: Vec<Outcome>, ask: ClaimAsk) {
        let items: Vec<(Claim, Finalize)> =
            batch.iter().map(|o| (o.claim, o.action.clone())).collect();
        let sent = Instant::now();
        let result = self
            .backend
            .finalize_and_claim(&items, ask.request.clone())
            .await;
        if !batch.is_empty() {
            self.metrics.finalize(sent.elapsed());
        }
        match result {
            Ok((outcomes, claimed)) => {
                self.answer(ask.reply, Ok(claimed)).await;
                let written = outcomes.into_iter().map(Written::Done).collect();
                self.report_all(&batch, written);
            }
            Err(err) => {
                let claimed = self.backend.claim(ask.request).await;
                self.answer(ask.reply, claimed).await;
                if !batch.is_empty() {
                    events::finalize_retry(self.backend.queue(), batch.len(), &err, Duration::ZERO);
                    self.write_batch(batch, err.is_transient()).await;
                }
            }
        }
    }

    /// Hands a claim's result to the dispatcher; if it stopped waiting (its shutdown gave up
    /// on the claim), gives the jobs back.
    async fn answer(
        &self,
        reply: oneshot::Sender<Result<ClaimBatch>>,
        claimed: Result<ClaimBatch>,
    ) {
        if let Err(Ok(orphans)) = reply.send(claimed) {
            let outcomes = orphans
                .jobs
                .iter()
                .map(|job| {
                    events::claim_released(
                        self.backend.queue(),
                        job.claim(),
                        "the claimer stopped waiting",
                    );
                    Outcome {
                        claim: job.claim(),
                        action: Finalize::Release,
                        deadline: Instant::now() + LONGEST_PAUSE,
                    }
                })
                .collect();
            self.write_batch(outcomes, false).await;
        }
    }

    /// Counts an outcome and emits its event.
    fn report(&self, claim: Claim, action: &Finalize, written: &Written) {
        emit(self.backend.queue(), claim, action, written);
        measure(&self.metrics, action, written);
        self.stats.send_modify(|s| count(s, action, written));
        record_stale(&self.backend, u64::from(is_stale(written)));
    }

    /// [`Writer::report`] for a batch, with one update of the counters: every update wakes the
    /// stats' watchers.
    fn report_all(&self, batch: &[Outcome], written: Vec<Written>) {
        let queue = self.backend.queue();
        for (outcome, written) in batch.iter().zip(&written) {
            emit(queue, outcome.claim, &outcome.action, written);
            measure(&self.metrics, &outcome.action, written);
        }
        self.stats.send_modify(|s| {
            for (outcome, written) in batch.iter().zip(&written) {
                count(s, &outcome.action, written);
            }
        });
        let stale = written.iter().filter(|w| is_stale(w)).count() as u64;
        record_stale(&self.backend, stale);
    }
}

fn is_stale(written: &Written) -> bool {
    matches!(written, Written::Done(FinalizeOutcome::Stale))
}

/// Tells the store about `count` fenced outcomes, in a task of its own, best effort: the
/// counter operators read ([`crate::QueueControl::stale_fences`]) must never hold up or fail
/// the worker.
pub(super) fn record_stale<B: Backend>(backend: &B, count: u64) {
    if count == 0 {
        return;
    }
    let backend = backend.clone();
    tokio::spawn(async move {
        let _ = backend.record_stale(count).await;
    });
}

fn emit(queue: &crate::types::QueueName, claim: Claim, action: &Finalize, written: &Written) {
    match written {
        Written::Done(outcome) => events::finalized(queue, claim, action, *outcome),
        Written::Unknown => events::finalize_unknown(queue, claim, action),
        Written::Failed(err) => events::finalize_failed(queue, Some(claim), 1, err),
    }
}

fn measure(metrics: &QueueMetrics, action: &Finalize, written: &Written) {
    match written {
        Written::Done(outcome) => metrics.written(action, *outcome),
        Written::Unknown => metrics.unknown(),
        Written::Failed(_) => metrics.finalize_failed(1),
    }
}

fn count(stats: &mut WorkerStats, action: &Finalize, written: &Written) {
    match written {
        Written::Done(outcome) => stats.record(action, *outcome),
        Written::Unknown => stats.unknown += 1,
        Written::Failed(_) => stats.finalize_errors += 1,
    }
}

/// Collects outcomes of hookless jobs and writes them in batches: each job is still fenced on
/// its own generation, one outcome per job. When claims carry outcomes, it also sends the
/// dispatcher's claims, each with what is waiting.
struct Batcher<B> {
    writer: Arc<Writer<B>>,
    rx: mpsc::Receiver<Outcome>,
    asks: Option<mpsc::Receiver<ClaimAsk>>,
    done: CancellationToken,
}

impl<B: Backend> Batcher<B> {
    async fn run(mut self) {
        let mut batch = Vec::with_capacity(BATCH_LIMIT);
        loop {
            let mut ask = None;
            tokio::select! {
                biased;
                Some(asked) = recv_ask(&mut self.asks) => ask = Some(asked),
                _ = self.rx.recv_many(&mut batch, BATCH_LIMIT) => {}
                _ = self.done.cancelled() => {}
            }
            if ask.is_none() && !batch.is_empty() && !self.done.is_cancelled() {
                ask = self.linger(&mut batch).await;
            }
            // Whatever else is waiting goes too (all of it at shutdown).
            while batch.len() < BATCH_LIMIT {
                match self.rx.try_recv() {
                    Ok(item) => batch.push(item),
                    Err(_) => break,
                }
            }
            let outcomes = std::mem::replace(&mut batch, Vec::with_capacity(BATCH_LIMIT));
            match ask {
                Some(ask) => self.writer.write_with_claim(outcomes, ask).await,
                None if outcomes.is_empty() => return,
                None => self.writer.write_batch(outcomes, false).await,
            }
        }
    }

    /// Holds `batch` for a claim to carry it, up to [`LINGER`] or until it is full; returns the
    /// claim if one came. Returns at once when claims do not carry outcomes.
    async fn linger(&mut self, batch: &mut Vec<Outcome>) -> Option<ClaimAsk> {
        let asks = self.asks.as_mut()?;
        let until = Instant::now() + LINGER;
        while batch.len() < BATCH_LIMIT {
            tokio::select! {
                biased;
                asked = asks.recv() => return asked,
                got = self.rx.recv_many(batch, BATCH_LIMIT - batch.len()) => {
                    if got == 0 {
                        return None;
                    }
                }
                _ = tokio::time::sleep_until(until) => return None,
                _ = self.done.cancelled() => return None,
            }
        }
        None
    }
}

/// The next claim asked for, or never when claims do not carry outcomes (or no one can ask).
async fn recv_ask(asks: &mut Option<mpsc::Receiver<ClaimAsk>>) -> Option<ClaimAsk> {
    match asks {
        Some(asks) => asks.recv().await,
        None => std::future::pending().await,
    }
}

/// Collects outcomes of jobs with hooks and writes them many to a transaction, a savepoint per
/// job ([`finalize_batch`]), up to [`HOOKED_WRITERS`] transactions at once. A job whose hook
/// failed, and every job of a transaction that failed as a whole, is written again alone on
/// the one-job schedule, in a task of its own so that the batches keep flowing.
struct HookedBatcher<B: Backend, P> {
    hooked: Arc<Hooked<B, P>>,
    outstanding: Arc<Outstanding>,
    rx: mpsc::Receiver<HookedOutcome>,
    done: CancellationToken,
    alone: JoinSet<()>,
}

/// The release [`BatchTask::finish`] runs: every outcome with hooks still unwritten is given
/// back in one fenced write, without the hooks (a release ends nothing for them to record).
fn release_unwritten<B: Backend>(writer: Arc<Writer<B>>, outstanding: Arc<Outstanding>) -> Release {
    Box::new(move || {
        Box::pin(async move {
            let claims: Vec<Claim> = outstanding
                .claims
                .lock()
                .expect("not poisoned")
                .drain()
                .collect();
            if claims.is_empty() {
                return;
            }
            let queue = writer.backend.queue();
            let outcomes = claims
                .into_iter()
                .map(|claim| {
                    events::claim_released(queue, claim, "unwritten at the shutdown deadline");
                    Outcome {
                        claim,
                        action: Finalize::Release,
                        deadline: Instant::now(),
                    }
                })
                .collect();
            writer.write_batch(outcomes, false).await;
        })
    })
}

/// Outcomes to write again alone, with what their batch's try left.
type Leftovers = Vec<(HookedOutcome, Tried)>;

impl<B, P> HookedBatcher<B, P>
where
    B: Backend,
    P: DeserializeOwned + Send + Sync + 'static,
{
    async fn run(mut self) {
        let mut writing: JoinSet<Leftovers> = JoinSet::new();
        // What each batch's task carries, to account for it if the task panics.
        let mut carried: HashMap<tokio::task::Id, Vec<(Claim, Finalize)>> = HashMap::new();
        let mut batch = Vec::with_capacity(HOOKED_BATCH_LIMIT);
        loop {
            let closing = tokio::select! {
                biased;
                Some(written) = writing.join_next_with_id(), if !writing.is_empty() => {
                    self.written(written, &mut carried);
                    continue;
                }
                _ = self.rx.recv_many(&mut batch, HOOKED_BATCH_LIMIT),
                    if writing.len() < HOOKED_WRITERS => false,
                _ = self.done.cancelled(), if writing.len() < HOOKED_WRITERS => true,
            };
            if closing {
                while batch.len() < HOOKED_BATCH_LIMIT {
                    match self.rx.try_recv() {
                        Ok(item) => batch.push(item),
                        Err(_) => break,
                    }
                }
            }
            while self.alone.try_join_next().is_some() {}
            if batch.is_empty() {
                // What is being written, and what is written alone, ends within its jobs'
                // deadlines (or shutdown's).
                while let Some(written) = writing.join_next_with_id().await {
                    self.written(written, &mut carried);
                }
                while self.alone.join_next().await.is_some() {}
                return;
            }
            let outcomes = std::mem::replace(&mut batch, Vec::with_capacity(HOOKED_BATCH_LIMIT));
            let claims = outcomes
                .iter()
                .map(|o| (o.job.claim(), o.action.clone()))
                .collect();
            let task = writing.spawn(write_hooked(
                self.hooked.clone(),
                self.outstanding.clone(),
                outcomes,
            ));
            carried.insert(task.id(), claims);
        }
    }

    /// Takes a batch's task's end: what it could not write is written alone, each in a task of
    /// its own; if it panicked, its jobs are reported failed (they wait for their leases).
    fn written(
        &mut self,
        joined: Result<(tokio::task::Id, Leftovers), tokio::task::JoinError>,
        carried: &mut HashMap<tokio::task::Id, Vec<(Claim, Finalize)>>,
    ) {
        let leftovers = match joined {
            Ok((id, leftovers)) => {
                carried.remove(&id);
                leftovers
            }
            Err(err) => {
                let writer = &self.hooked.writer;
                for (claim, action) in carried.remove(&err.id()).unwrap_or_default() {
                    self.outstanding.done(claim);
                    let failure = Error::Backend {
                        source: format!("writing a batch of outcomes failed: {err}").into(),
                        transient: false,
                    };
                    writer.report(claim, &action, &Written::Failed(failure));
                }
                return;
            }
        };
        for (outcome, tried) in leftovers {
            let hooked = self.hooked.clone();
            let outstanding = self.outstanding.clone();
            self.alone.spawn(async move {
                let claim = outcome.job.claim();
                let HookedOutcome {
                    job,
                    action,
                    deadline,
                    _place,
                } = outcome;
                hooked.finish_now(&job, action, deadline, tried).await;
                outstanding.done(claim);
            });
        }
    }
}

/// Writes `batch` in one transaction and reports what it wrote; returns what must be written
/// again alone.
async fn write_hooked<B, P>(
    hooked: Arc<Hooked<B, P>>,
    outstanding: Arc<Outstanding>,
    batch: Vec<HookedOutcome>,
) -> Leftovers
where
    B: Backend,
    P: DeserializeOwned + Send + Sync + 'static,
{
    let writer = &hooked.writer;
    let queue = writer.backend.queue();
    let items: Vec<(&ClaimedJob, &Finalize)> = batch.iter().map(|o| (&o.job, &o.action)).collect();
    let sent = Instant::now();
    let result = finalize_batch(&writer.backend, &hooked.hooks, &items).await;
    writer.metrics.finalize(sent.elapsed());
    drop(items);
    let answers = match result {
        Ok(answers) => answers,
        Err(err) => {
            events::finalize_retry(queue, batch.len(), &err, Duration::ZERO);
            let tried = Tried {
                maybe_written: err.is_transient(),
                hook_failures: 0,
            };
            return batch.into_iter().map(|o| (o, tried)).collect();
        }
    };
    let mut leftovers = Vec::new();
    for (outcome, answer) in batch.into_iter().zip(answers) {
        match answer {
            Ok(written) => {
                let claim = outcome.job.claim();
                writer.report(claim, &outcome.action, &Written::Done(written));
                outstanding.done(claim);
            }
            Err(err) => {
                writer.metrics.hook_failed();
                events::finalize_retry(queue, 1, &err, Duration::ZERO);
                let tried = Tried {
                    maybe_written: false,
                    hook_failures: 1,
                };
                leftovers.push((outcome, tried));
            }
        }
    }
    leftovers
}
