//! The one place a worker writes a job's outcome: fenced, with the hooks when there are any, in
//! batches when there are none, tried again on failure on one schedule, and every outcome
//! counted and reported through [`events`].

use std::future::Future;
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::stats::WorkerStats;
use crate::backend::Backend;
use crate::error::Result;
use crate::events;
use crate::hooks::{Hooks, finalize_once};
use crate::types::{Claim, ClaimedJob, Finalize, FinalizeOutcome, QueueName};

/// The pauses between tries of a failed finalize, whatever its kind (the database or a hook):
/// the fence makes a late try harmless, and a job whose finalize keeps failing waits for its
/// lease to lapse.
const RETRY_DELAYS: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// The most outcomes one batched write carries.
const BATCH_LIMIT: usize = 512;

/// Writes outcomes for one worker.
pub(super) struct Finalizer<B: Backend, P> {
    backend: B,
    hooks: Hooks<B::Tx, P>,
    stats: watch::Sender<WorkerStats>,
    /// Where outcomes go to be written in batches; `None` when hooks need a transaction per job
    /// or batching is off.
    batch: Option<mpsc::Sender<(Claim, Finalize)>>,
}

/// The batching task, stopped once no job can send to it any more.
pub(super) struct BatchTask {
    task: JoinHandle<()>,
    done: CancellationToken,
}

impl BatchTask {
    /// Lets the task write what it holds and waits for it to end.
    pub(super) async fn finish(self) {
        self.done.cancel();
        let _ = self.task.await;
    }
}

impl<B, P> Finalizer<B, P>
where
    B: Backend,
    P: DeserializeOwned + Send + Sync + 'static,
{
    /// A finalizer; with `batch` and no hooks it also starts the batching task, whose queue
    /// holds `capacity` outcomes.
    pub(super) fn start(
        backend: B,
        hooks: Hooks<B::Tx, P>,
        stats: watch::Sender<WorkerStats>,
        batch: bool,
        capacity: usize,
    ) -> (Self, Option<BatchTask>) {
        let (sender, task) = if batch && hooks.is_empty() {
            let (tx, rx) = mpsc::channel(capacity.max(BATCH_LIMIT) * 2);
            let done = CancellationToken::new();
            let batcher = Batcher {
                backend: backend.clone(),
                rx,
                stats: stats.clone(),
                done: done.clone(),
            };
            let task = tokio::spawn(batcher.run());
            (Some(tx), Some(BatchTask { task, done }))
        } else {
            (None, None)
        };
        let finalizer = Finalizer {
            backend,
            hooks,
            stats,
            batch: sender,
        };
        (finalizer, task)
    }

    /// Writes a job's outcome: handed to the batching task when there is one, written now
    /// otherwise.
    pub(super) async fn finish(&self, job: &ClaimedJob, action: Finalize) {
        if let Some(batch) = &self.batch
            && batch.send((job.claim(), action.clone())).await.is_ok()
        {
            return;
        }
        self.finish_now(job, action).await;
    }

    /// Writes a job's outcome now, hooks included; true when the write applied.
    pub(super) async fn finish_now(&self, job: &ClaimedJob, action: Finalize) -> bool {
        let queue = self.backend.queue();
        let result = with_retries(queue, 1, || {
            finalize_once(&self.backend, &self.hooks, job, &action)
        })
        .await;
        let applied = matches!(result, Ok(FinalizeOutcome::Applied));
        report(queue, &self.stats, job.claim(), &action, result);
        applied
    }

    /// Gives a claimed job back unstarted (fenced); true when the release applied.
    pub(super) async fn release(&self, job: &ClaimedJob, reason: &str) -> bool {
        events::claim_released(self.backend.queue(), job.claim(), reason);
        self.finish_now(job, Finalize::Release).await
    }

    /// Gives back the jobs whose tasks were aborted at the shutdown deadline: one batched,
    /// fenced write, tried once and without hooks (a release ends nothing for them to record),
    /// so that shutdown keeps its deadline. A job whose release fails waits for its lease.
    pub(super) async fn release_aborted(&self, jobs: &[std::sync::Arc<ClaimedJob>]) {
        if jobs.is_empty() {
            return;
        }
        let queue = self.backend.queue();
        let items: Vec<(Claim, Finalize)> = jobs
            .iter()
            .map(|job| {
                events::claim_released(queue, job.claim(), "aborted at the shutdown deadline");
                (job.claim(), Finalize::Release)
            })
            .collect();
        match self.backend.finalize_many(&items).await {
            Ok(outcomes) => {
                for ((claim, action), outcome) in items.iter().zip(outcomes) {
                    report(queue, &self.stats, *claim, action, Ok(outcome));
                }
            }
            Err(err) => {
                events::finalize_failed(queue, None, items.len(), &err);
                self.stats
                    .send_modify(|s| s.finalize_errors += items.len() as u64);
            }
        }
    }
}

/// Runs `attempt` until it succeeds or [`RETRY_DELAYS`] is used up.
async fn with_retries<T, F, Fut>(queue: &QueueName, jobs: usize, mut attempt: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut delays = RETRY_DELAYS.iter();
    loop {
        match attempt().await {
            Err(err) => match delays.next() {
                Some(&delay) => {
                    events::finalize_retry(queue, jobs, &err, delay);
                    tokio::time::sleep(delay).await;
                }
                None => return Err(err),
            },
            done => return done,
        }
    }
}

/// Counts an outcome and emits its event.
fn report(
    queue: &QueueName,
    stats: &watch::Sender<WorkerStats>,
    claim: Claim,
    action: &Finalize,
    result: Result<FinalizeOutcome>,
) {
    match result {
        Ok(outcome) => {
            events::finalized(queue, claim, action, outcome);
            stats.send_modify(|s| s.record(action, outcome));
        }
        Err(err) => {
            events::finalize_failed(queue, Some(claim), 1, &err);
            stats.send_modify(|s| s.finalize_errors += 1);
        }
    }
}

/// Collects outcomes of hookless jobs and writes them in batches: each job is still fenced on
/// its own generation, one outcome per job.
struct Batcher<B> {
    backend: B,
    rx: mpsc::Receiver<(Claim, Finalize)>,
    stats: watch::Sender<WorkerStats>,
    done: CancellationToken,
}

impl<B: Backend> Batcher<B> {
    async fn run(mut self) {
        let mut batch = Vec::with_capacity(BATCH_LIMIT);
        loop {
            tokio::select! {
                biased;
                _ = self.rx.recv_many(&mut batch, BATCH_LIMIT) => {}
                _ = self.done.cancelled() => {
                    while batch.len() < BATCH_LIMIT {
                        match self.rx.try_recv() {
                            Ok(item) => batch.push(item),
                            Err(_) => break,
                        }
                    }
                }
            }
            if batch.is_empty() {
                return;
            }
            self.write(&batch).await;
            batch.clear();
        }
    }

    async fn write(&self, batch: &[(Claim, Finalize)]) {
        let queue = self.backend.queue();
        let result = with_retries(queue, batch.len(), || self.backend.finalize_many(batch)).await;
        match result {
            Ok(outcomes) => {
                for ((claim, action), outcome) in batch.iter().zip(&outcomes) {
                    events::finalized(queue, *claim, action, *outcome);
                }
                // One update for the whole batch: every update wakes the stats' watchers.
                self.stats.send_modify(|s| {
                    for ((_, action), outcome) in batch.iter().zip(&outcomes) {
                        s.record(action, *outcome);
                    }
                });
            }
            Err(err) => {
                events::finalize_failed(queue, None, batch.len(), &err);
                self.stats
                    .send_modify(|s| s.finalize_errors += batch.len() as u64);
            }
        }
    }
}
