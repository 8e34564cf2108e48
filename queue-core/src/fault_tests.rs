//! The runtime under faults the in-memory store does not have on its own: a database that fails
//! or hangs, a reply lost after its commit, heartbeats that do not get through. A [`Faulty`]
//! backend wraps the in-memory one and injects them; tokio's clock is paused and moved, so
//! leases and pauses pass without sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::events::capture::Captured;
use crate::{
    Backend, CancelReason, CancelTarget, Claim, ClaimBatch, ClaimRequest, Enqueued, Error,
    Finalize, FinalizeOutcome, Handler, Heartbeat, JobContext, JobError, JobId, JobRecord,
    JobStatus, Lease, MemoryBackend, MemoryTx, NewJob, QueueCounts, QueueName, Result, Worker,
    WorkerConfig,
};

/// What a [`Faulty`] backend does wrong, switched on and off by the test.
#[derive(Default)]
struct Faults {
    /// Claims fail with a connection error.
    claims_fail: AtomicBool,
    /// Enqueues fail with a connection error.
    enqueues_fail: AtomicBool,
    /// Outcome writes (`finalize`, `finalize_many`, `begin`) fail with a connection error.
    writes_fail: AtomicBool,
    /// Heartbeats (`extend_lease`) fail with a connection error.
    heartbeats_fail: AtomicBool,
    /// Heartbeats (`extend_lease`) wait forever: a row lock never released, a black hole.
    heartbeats_hang: AtomicBool,
    /// So many of the next heartbeats (`extend_lease`) wait forever: a connection gone dead
    /// under one call while the pool's others work.
    next_heartbeats_hang: AtomicU32,
    /// The next outcome write commits, then its reply is lost (a connection error).
    lose_next_reply: AtomicBool,
    /// With `lose_next_reply`: before the lost reply comes back, another worker claims the job
    /// the write sent back to `pending`.
    steal_after_lost_reply: AtomicBool,
    /// Every call waits forever: a database that accepts connections and never answers.
    hang: AtomicBool,
    /// A scheduler's records of its schedules (`record_schedules`) fail with a connection error.
    records_fail: AtomicBool,
    /// A claim's answer comes back 200 ms after the store read it (a slow round trip), and no
    /// wake-up signal is given (as on PostgreSQL, where an outcome sends no NOTIFY).
    slow_claims_no_wake: AtomicBool,
    claim_calls: AtomicU32,
    enqueue_calls: AtomicU32,
    /// Fires at every enqueue call, before its fault gate.
    enqueue_called: Notify,
}

#[derive(Clone)]
struct Faulty {
    inner: MemoryBackend,
    faults: Arc<Faults>,
}

impl Faulty {
    fn new() -> Self {
        Faulty {
            inner: MemoryBackend::new(),
            faults: Arc::default(),
        }
    }

    fn set(&self, fault: impl Fn(&Faults) -> &AtomicBool, on: bool) {
        fault(&self.faults).store(on, Ordering::SeqCst);
    }

    async fn gate(&self, fault: impl Fn(&Faults) -> &AtomicBool) -> Result<()> {
        if self.faults.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if fault(&self.faults).load(Ordering::SeqCst) {
            return Err(Error::backend("connection refused (injected)", true));
        }
        Ok(())
    }

    fn reply_lost(&self) -> bool {
        self.faults.lose_next_reply.swap(false, Ordering::SeqCst)
    }
}

/// The admin API of the memory backend underneath, but for recording schedules, which may fail.
impl crate::Admin for Faulty {
    async fn list_jobs(&self, filter: &crate::JobFilter) -> Result<crate::JobPage> {
        self.inner.list_jobs(filter).await
    }
    async fn find_by_unique_key(&self, key: &str) -> Result<Option<JobRecord>> {
        self.inner.find_by_unique_key(key).await
    }
    async fn retry_in(
        &self,
        tx: &mut MemoryTx,
        id: JobId,
        seen: JobStatus,
    ) -> Result<crate::RetryTarget> {
        self.inner.retry_in(tx, id, seen).await
    }
    async fn purge_batch(&self, request: &crate::PurgeRequest) -> Result<u64> {
        self.inner.purge_batch(request).await
    }
    async fn pause(&self) -> Result<crate::QueueControl> {
        self.inner.pause().await
    }
    async fn resume(&self) -> Result<crate::QueueControl> {
        self.inner.resume().await
    }
    async fn control(&self) -> Result<crate::QueueControl> {
        self.inner.control().await
    }
    async fn set_limits(&self, limits: crate::QueueLimits) -> Result<crate::QueueControl> {
        self.inner.set_limits(limits).await
    }
    async fn record_schedules(
        &self,
        seen_by: &str,
        reports: &[crate::ScheduleReport],
    ) -> Result<()> {
        self.gate(|f| &f.records_fail).await?;
        self.inner.record_schedules(seen_by, reports).await
    }
    async fn schedules(&self) -> Result<Vec<crate::ScheduleInfo>> {
        self.inner.schedules().await
    }
    async fn forget_schedule(&self, name: &str) -> Result<bool> {
        self.inner.forget_schedule(name).await
    }
    async fn queues(&self) -> Result<Vec<QueueName>> {
        self.inner.queues().await
    }
    fn for_queue(&self, queue: QueueName) -> Self {
        Faulty {
            inner: self.inner.for_queue(queue),
            faults: self.faults.clone(),
        }
    }
    async fn throughput(&self, minutes: u32) -> Result<Vec<crate::MinuteCounts>> {
        self.inner.throughput(minutes).await
    }
}

impl Backend for Faulty {
    type Tx = MemoryTx;

    fn queue(&self) -> &QueueName {
        self.inner.queue()
    }

    async fn enqueue(&self, job: NewJob) -> Result<Enqueued> {
        self.gate(|f| &f.enqueues_fail).await?;
        self.inner.enqueue(job).await
    }

    async fn enqueue_many(&self, jobs: Vec<NewJob>) -> Result<Vec<Enqueued>> {
        self.faults.enqueue_calls.fetch_add(1, Ordering::SeqCst);
        self.faults.enqueue_called.notify_one();
        self.gate(|f| &f.enqueues_fail).await?;
        self.inner.enqueue_many(jobs).await
    }

    async fn enqueue_in(&self, tx: &mut MemoryTx, job: NewJob) -> Result<Enqueued> {
        self.inner.enqueue_in(tx, job).await
    }

    async fn begin(&self) -> Result<MemoryTx> {
        self.gate(|f| &f.writes_fail).await?;
        self.inner.begin().await
    }

    async fn claim(&self, request: ClaimRequest) -> Result<ClaimBatch> {
        self.faults.claim_calls.fetch_add(1, Ordering::SeqCst);
        self.gate(|f| &f.claims_fail).await?;
        let batch = self.inner.claim(request).await;
        if self.faults.slow_claims_no_wake.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        batch
    }

    async fn finalize_in(
        &self,
        tx: &mut MemoryTx,
        claim: Claim,
        action: &Finalize,
    ) -> Result<FinalizeOutcome> {
        self.inner.finalize_in(tx, claim, action).await
    }

    async fn finalize(&self, claim: Claim, action: &Finalize) -> Result<FinalizeOutcome> {
        Ok(self.finalize_many(&[(claim, action.clone())]).await?[0])
    }

    async fn finalize_many(&self, items: &[(Claim, Finalize)]) -> Result<Vec<FinalizeOutcome>> {
        self.gate(|f| &f.writes_fail).await?;
        let outcomes = self.inner.finalize_many(items).await?;
        if self.reply_lost() {
            if self.faults.steal_after_lost_reply.load(Ordering::SeqCst) {
                let request = ClaimRequest::new(items.len() as u32, Lease::DEFAULT);
                self.inner.claim(request).await?;
            }
            return Err(Error::backend(
                "connection reset after commit (injected)",
                true,
            ));
        }
        Ok(outcomes)
    }

    async fn extend_lease(&self, claim: Claim, lease: Lease) -> Result<Heartbeat> {
        let hang_this = self
            .faults
            .next_heartbeats_hang
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if hang_this || self.faults.heartbeats_hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.gate(|f| &f.heartbeats_fail).await?;
        self.inner.extend_lease(claim, lease).await
    }

    async fn cancel_in(&self, tx: &mut MemoryTx, id: JobId) -> Result<CancelTarget> {
        self.inner.cancel_in(tx, id).await
    }

    async fn get(&self, id: JobId) -> Result<Option<JobRecord>> {
        self.gate(|f| &f.hang).await?;
        self.inner.get(id).await
    }

    async fn counts(&self) -> Result<QueueCounts> {
        self.inner.counts().await
    }

    async fn stats(&self, window: Duration) -> Result<crate::QueueStats> {
        self.inner.stats(window).await
    }

    fn wake_signal(&self) -> Option<Arc<Notify>> {
        if self.faults.slow_claims_no_wake.load(Ordering::SeqCst) {
            return None;
        }
        self.inner.wake_signal()
    }
}

struct Quick;

impl Handler for Quick {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        Ok(())
    }
}

/// A long job that runs until its token fires, and says why it fired.
#[derive(Default)]
struct UntilCancelled {
    started: Arc<Notify>,
    reasons: Arc<std::sync::Mutex<Vec<Option<CancelReason>>>>,
}

impl Handler for UntilCancelled {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, _p: Value) -> Result<(), JobError> {
        self.started.notify_one();
        ctx.cancellation().cancelled().await;
        self.reasons.lock().unwrap().push(ctx.cancel_reason());
        Err(JobError::retry("stopped"))
    }
    fn runs_long(&self) -> bool {
        true
    }
}

fn quick(config: WorkerConfig) -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(100),
        ..config
    }
}

/// Database trouble far longer than a second does not cost the outcomes: the one retry
/// schedule keeps trying until the job's lease deadline.
#[tokio::test(start_paused = true)]
async fn outcomes_outlast_a_long_database_outage_within_the_lease() {
    let queue = Faulty::new();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    queue.set(|f| &f.writes_fail, true);
    let worker = Worker::new(queue.clone(), Quick, quick(WorkerConfig::default()))
        .unwrap()
        .start();
    worker.wait_for(|s| s.started == 1).await;
    // Thirty seconds of outage (the lease is 90 s).
    tokio::time::sleep(Duration::from_secs(30)).await;
    queue.set(|f| &f.writes_fail, false);
    let stats = worker
        .wait_for_timeout(Duration::from_secs(60), |s| s.completed == 1)
        .await
        .expect("the outcome is written once the database is back");
    worker.shutdown().await.unwrap();
    assert_eq!(stats.finalize_errors, 0);
    assert_eq!(queue.inner.counts().await.unwrap().completed, 1);
}

/// A write that committed but whose reply was lost finds the job no longer in flight when it is
/// tried again: it is reported as applied (the job shows this claim's write), never as another
/// worker's fence.
#[tokio::test(start_paused = true)]
async fn a_commit_whose_reply_was_lost_is_not_reported_stale() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = Faulty::new();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    queue.set(|f| &f.lose_next_reply, true);
    let worker = Worker::new(queue.clone(), Quick, quick(WorkerConfig::default()))
        .unwrap()
        .start();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(30), |s| s.finished() == 1)
        .await
        .unwrap();
    worker.shutdown().await.unwrap();
    drop(guard);
    assert_eq!((stats.completed, stats.stale, stats.unknown), (1, 0, 0));
    assert_eq!(captured.count(crate::events::STALE_FINALIZE_FENCED), 0);
}

/// Fails every run, to be retried at once.
struct AlwaysRetry;

impl Handler for AlwaysRetry {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        Err(JobError::retry("try again"))
    }
}

/// A retry whose commit reply was lost, after which another worker claimed the job: the row
/// cannot tell whether this write landed, so the outcome is reported unknown (event
/// `queue.finalize_unknown`), not applied and not stale.
#[tokio::test(start_paused = true)]
async fn a_lost_reply_the_row_cannot_confirm_is_reported_unknown() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = Faulty::new();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    queue.set(|f| &f.lose_next_reply, true);
    queue.set(|f| &f.steal_after_lost_reply, true);
    let config = WorkerConfig {
        retry: crate::RetryPolicy {
            base_delay: Duration::ZERO,
            jitter: false,
            ..crate::RetryPolicy::default()
        },
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), AlwaysRetry, config)
        .unwrap()
        .start();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(30), |s| s.unknown == 1)
        .await
        .expect("the outcome is reported unknown");
    worker.shutdown().await.unwrap();
    drop(guard);
    assert_eq!((stats.retried, stats.stale), (0, 0));
    assert_eq!(captured.count(crate::events::FINALIZE_UNKNOWN), 1);
    assert_eq!(captured.count(crate::events::STALE_FINALIZE_FENCED), 0);
}

/// Heartbeats that cannot get through (a pool exhausted, a database gone) cancel the handler
/// once the worker can no longer trust its lease, and tell it why.
#[tokio::test(start_paused = true)]
async fn failed_heartbeats_cancel_the_handler_once_the_lease_cannot_be_trusted() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = Faulty::new();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    queue.set(|f| &f.heartbeats_fail, true);
    let handler = UntilCancelled::default();
    let (started, reasons) = (handler.started.clone(), Arc::clone(&handler.reasons));
    let lease = Lease::from_secs(60).unwrap();
    let config = WorkerConfig {
        lease,
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let began = tokio::time::Instant::now();
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    started.notified().await;
    worker
        .wait_for_timeout(Duration::from_secs(120), |s| s.finished() == 1)
        .await
        .expect("the handler is cancelled and its outcome written");
    let cancelled_after = began.elapsed();
    worker.shutdown().await.unwrap();
    drop(guard);
    assert_eq!(
        *reasons.lock().unwrap(),
        vec![Some(CancelReason::LeaseUntrusted)]
    );
    // Five sixths of the 60 s lease, before it could expire.
    assert!(
        cancelled_after >= Duration::from_secs(49) && cancelled_after < Duration::from_secs(60),
        "{cancelled_after:?}"
    );
    assert_eq!(captured.count(crate::events::LEASE_UNTRUSTED), 1);
    assert_eq!(captured.count(crate::events::HEARTBEAT_FAILED), 2);
}

/// The worker's renewals go many to a call, and a call that never answers (its connection went
/// dead) holds up only the renewals it carries: the job whose heartbeat it carried stops once
/// its lease cannot be trusted, while the other job's heartbeats, asked later, go in calls of
/// their own and keep it running.
#[tokio::test(start_paused = true)]
async fn a_renewal_call_that_never_answers_holds_up_only_its_own_renewals() {
    let queue = Faulty::new();
    let handler = UntilCancelled::default();
    let (started, reasons) = (handler.started.clone(), Arc::clone(&handler.reasons));
    let config = WorkerConfig {
        concurrency: 2,
        lease: Lease::from_secs(60).unwrap(),
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    queue
        .enqueue(NewJob::from_value(json!({ "n": 1 })))
        .await
        .unwrap();
    started.notified().await;
    // The second job starts ten seconds after the first, so their heartbeats fall apart.
    tokio::time::sleep(Duration::from_secs(10)).await;
    queue
        .enqueue(NewJob::from_value(json!({ "n": 2 })))
        .await
        .unwrap();
    started.notified().await;
    // The next call (the first job's heartbeat, at 20 s) never answers.
    queue.faults.next_heartbeats_hang.store(1, Ordering::SeqCst);
    worker
        .wait_for_timeout(Duration::from_secs(60), |s| s.finished() == 1)
        .await
        .expect("the first job stops once its lease cannot be trusted");
    assert_eq!(
        *reasons.lock().unwrap(),
        vec![Some(CancelReason::LeaseUntrusted)]
    );
    // Two leases later the second still runs on its heartbeats.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(worker.stats().finished(), 1, "the second job still runs");
    assert_eq!(reasons.lock().unwrap().len(), 1);
    worker.shutdown().await.unwrap();
}

/// Four calls stuck at once (as many as run side by side) do not stop the renewals of the
/// other jobs: a stuck call stops counting once it is slow, and is dropped once its askers
/// stopped waiting.
#[tokio::test(start_paused = true)]
async fn four_stuck_renewal_calls_hold_up_no_other_job() {
    let queue = Faulty::new();
    let handler = UntilCancelled::default();
    let (started, reasons) = (handler.started.clone(), Arc::clone(&handler.reasons));
    let config = WorkerConfig {
        concurrency: 5,
        // A claim for every free slot: each job claimed as it is enqueued.
        max_batch: 1,
        lease: Lease::from_secs(60).unwrap(),
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    for n in 0..5 {
        queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .unwrap();
        started.notified().await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // The next four calls never answer: the first four jobs' heartbeats, two seconds apart,
    // each in a call of its own; the fifth job's comes while those four are out.
    queue.faults.next_heartbeats_hang.store(4, Ordering::SeqCst);
    worker
        .wait_for_timeout(Duration::from_secs(120), |s| s.finished() == 4)
        .await
        .expect("the four jobs whose heartbeats hung stop");
    tokio::time::sleep(Duration::from_secs(180)).await;
    assert_eq!(worker.stats().finished(), 4, "the fifth job still runs");
    assert_eq!(
        *reasons.lock().unwrap(),
        vec![Some(CancelReason::LeaseUntrusted); 4]
    );
    worker.shutdown().await.unwrap();
}

/// A long job that waits for its gate.
struct LongGated {
    started: Arc<Notify>,
    open: Arc<Notify>,
}

impl Handler for LongGated {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        self.started.notify_one();
        self.open.notified().await;
        Ok(())
    }
    fn runs_long(&self) -> bool {
        true
    }
}

/// A prefetched long job that another worker took over while it waited in the buffer is not
/// started: a fenced heartbeat before the start finds the lease lost.
#[tokio::test(start_paused = true)]
async fn a_prefetched_long_job_taken_over_while_buffered_never_starts() {
    let queue = MemoryBackend::new();
    queue
        .enqueue(NewJob::from_value(json!({ "n": 1 })))
        .await
        .unwrap();
    let second = queue
        .enqueue(NewJob::from_value(json!({ "n": 2 })))
        .await
        .unwrap()
        .id;
    let (started, open) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = LongGated {
        started: started.clone(),
        open: open.clone(),
    };
    let lease = Lease::from_secs(60).unwrap();
    let config = WorkerConfig {
        concurrency: 1,
        prefetch: 1,
        max_batch: 2,
        lease,
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    started.notified().await;
    assert_eq!(worker.stats().claimed, 2, "one running, one buffered");
    // By the store's clock both leases run out; the running job's next heartbeat (at 20 s)
    // renews its own, the buffered one's stays expired and another worker takes it over.
    queue.advance_clock(Duration::from_secs(61));
    tokio::time::sleep(Duration::from_secs(21)).await;
    let thief = queue.claim(ClaimRequest::new(1, lease)).await.unwrap().jobs;
    assert_eq!(thief.iter().map(|j| j.id).collect::<Vec<_>>(), vec![second]);
    // The running job ends; the buffered one must not start.
    open.notify_one();
    worker
        .wait_for_timeout(Duration::from_secs(30), |s| {
            s.completed == 1 && s.stale == 1
        })
        .await
        .expect("the first completes and the second is found lost");
    let stats = worker.stats();
    worker.shutdown().await.unwrap();
    assert_eq!(stats.started, 1, "the taken-over job started anyway");
    let row = queue.get(second).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.claim_generation.0),
        (JobStatus::InFlight, 2)
    );
}

/// A prefetched long job whose cancel an operator requested while it waited in the buffer is
/// not started: the fenced renewal before its start reports the request, and the worker ends it
/// cancelled.
#[tokio::test(start_paused = true)]
async fn a_prefetched_long_job_cancelled_while_buffered_ends_without_running() {
    let queue = MemoryBackend::new();
    for n in 0..2 {
        queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .unwrap();
    }
    let (started, open) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = LongGated {
        started: started.clone(),
        open: open.clone(),
    };
    let config = WorkerConfig {
        concurrency: 1,
        prefetch: 1,
        max_batch: 2,
        lease: Lease::from_secs(60).unwrap(),
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    started.notified().await;
    assert_eq!(worker.stats().claimed, 2, "one running, one buffered");
    let buffered = JobId(2);
    // It waits in the buffer a while, and an operator cancels it there.
    tokio::time::advance(Duration::from_secs(5)).await;
    assert_eq!(
        queue.cancel(buffered).await.unwrap(),
        crate::types::CancelOutcome::Requested
    );
    open.notify_one();
    worker
        .wait_for_timeout(Duration::from_secs(30), |s| {
            s.completed == 1 && s.cancelled == 1
        })
        .await
        .expect("the first completes and the buffered one is cancelled");
    let stats = worker.stats();
    worker.shutdown().await.unwrap();
    assert_eq!(stats.started, 1, "the cancelled job started anyway");
    let row = queue.get(buffered).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Cancelled);
    assert_eq!(
        row.last_error.as_deref(),
        Some(crate::CANCEL_REQUESTED_MESSAGE)
    );
}

/// The renewal before a prefetched long job starts that never answers (a row lock held by an
/// open transaction, a black hole) holds that job's slot for a sixth of the lease, then the job
/// is given back; it never holds the dispatcher, and shutdown keeps its deadline.
#[tokio::test(start_paused = true)]
async fn a_renewal_before_start_that_never_answers_holds_up_nothing() {
    let queue = Faulty::new();
    for n in 0..2 {
        queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .unwrap();
    }
    let (started, open) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = LongGated {
        started: started.clone(),
        open: open.clone(),
    };
    let config = WorkerConfig {
        concurrency: 1,
        prefetch: 1,
        max_batch: 2,
        lease: Lease::from_secs(60).unwrap(),
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let bound = config.shutdown_timeout + config.shutdown_grace;
    let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
    started.notified().await;
    assert_eq!(worker.stats().claimed, 2, "one running, one buffered");
    // The buffered job's lease runs down by a third; then its renewal will hang.
    queue.set(|f| &f.heartbeats_hang, true);
    tokio::time::sleep(Duration::from_secs(21)).await;
    open.notify_one();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(60), |s| {
            s.completed == 1 && s.released == 1
        })
        .await
        .expect("the first completes and the second is given back after its renewal hung");
    // Given back, it was claimed again (a fresh lease needs no renewal) and runs.
    assert_eq!(stats.claimed, 3, "{stats:?}");
    let began = tokio::time::Instant::now();
    tokio::time::timeout(bound * 2, worker.shutdown())
        .await
        .expect("shutdown keeps its deadline")
        .unwrap();
    assert!(began.elapsed() <= bound, "{:?}", began.elapsed());
}

/// While claims fail, the worker backs off (doubling to 30 s) and says so once; it says once
/// when they work again.
#[tokio::test(start_paused = true)]
async fn a_database_outage_backs_claims_off_with_one_warning_and_one_recovery() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = Faulty::new();
    queue.set(|f| &f.claims_fail, true);
    let config = WorkerConfig {
        poll_interval: Duration::from_secs(1),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(queue.clone(), Quick, config).unwrap().start();
    tokio::time::sleep(Duration::from_secs(120)).await;
    let tries = queue.faults.claim_calls.load(Ordering::SeqCst);
    // Polling at 1 s would have tried 120 times; 1, 2, 4, 8, 16, then every 30 s (jitter
    // lengthens pauses), about 8.
    assert!(
        (4..=12).contains(&tries),
        "{tries} claims in 120 s of outage"
    );
    queue.set(|f| &f.claims_fail, false);
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    worker
        .wait_for_timeout(Duration::from_secs(120), |s| s.completed == 1)
        .await
        .expect("work resumes after the outage");
    worker.shutdown().await.unwrap();
    drop(guard);
    assert_eq!(captured.count(crate::events::CLAIM_FAILED), 1);
    assert_eq!(captured.count(crate::events::CLAIM_RECOVERED), 1);
}

/// A database that stops answering does not hold a shutdown past its deadline: every wait is
/// bounded by `shutdown_timeout + shutdown_grace`.
#[tokio::test(start_paused = true)]
async fn shutdown_keeps_its_deadline_when_the_database_hangs() {
    let queue = Faulty::new();
    for n in 0..3 {
        queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .unwrap();
    }
    let handler = UntilCancelled::default();
    let started = handler.started.clone();
    let config = WorkerConfig {
        concurrency: 1,
        prefetch: 2,
        max_batch: 3,
        job_timeout: Duration::from_secs(3600),
        ..quick(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), handler, config.clone())
        .unwrap()
        .start();
    started.notified().await;
    queue.set(|f| &f.hang, true);
    let began = tokio::time::Instant::now();
    let report = tokio::time::timeout(Duration::from_secs(600), worker.shutdown())
        .await
        .expect("shutdown returned")
        .unwrap();
    let took = began.elapsed();
    assert!(
        took <= config.shutdown_timeout + config.shutdown_grace + Duration::from_millis(100),
        "shutdown took {took:?}"
    );
    assert_eq!(report.released_unstarted, 0, "nothing can be written");
}

/// A scheduler whose store refuses enqueues keeps the period due, backs off, and enqueues it
/// once the store is back: nothing is lost, nothing doubled.
#[tokio::test]
async fn a_schedule_enqueues_its_period_once_the_store_is_back() {
    use crate::schedule::{Clock, ManualClock, Schedule, Scheduler};
    let backend = Faulty::new();
    backend.set(|f| &f.enqueues_fail, true);
    let clock = ManualClock::new("2026-01-01T00:00:30Z".parse().unwrap());
    let scheduler = Scheduler::new(backend.clone())
        .schedule(Schedule::every("rates", Duration::from_secs(60)).unwrap())
        .unwrap()
        .clock(clock.clone())
        .start()
        .unwrap();
    let failing = scheduler
        .wait_for(|s| s.schedules["rates"].failures >= 1)
        .await;
    assert_eq!(failing.schedules["rates"].through, None);
    backend.set(|f| &f.enqueues_fail, false);
    // The retry comes after the backoff (a second at first), by the scheduler's clock.
    clock.advance(Duration::from_secs(1));
    let back = scheduler
        .wait_for(|s| s.seen >= Some(clock.now()) && s.schedules["rates"].enqueued == 1)
        .await;
    assert_eq!(
        back.schedules["rates"].through,
        Some("2026-01-01T00:00:00Z".parse().unwrap())
    );
    scheduler.shutdown().await;
    assert_eq!(backend.inner.counts().await.unwrap().pending, 1);
}

/// A scheduler whose records of its schedules fail enqueues its periods all the same, logs
/// `queue.schedules_unrecorded`, and records them once the store takes them again.
#[tokio::test]
async fn a_scheduler_that_cannot_record_its_schedules_still_enqueues() {
    use crate::Admin;
    use crate::schedule::{Clock, ManualClock, Schedule, Scheduler};
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let backend = Faulty::new();
    backend.set(|f| &f.records_fail, true);
    let clock = ManualClock::new("2026-01-01T00:00:30Z".parse().unwrap());
    let scheduler = Scheduler::new(backend.clone())
        .schedule(Schedule::every("rates", Duration::from_secs(60)).unwrap())
        .unwrap()
        .clock(clock.clone())
        .start()
        .unwrap();
    let first = scheduler.wait_for(|s| s.seen >= Some(clock.now())).await;
    assert_eq!(first.schedules["rates"].enqueued, 1, "the period ran");
    assert!(captured.count(crate::events::SCHEDULES_UNRECORDED) >= 1);
    assert!(backend.schedules().await.unwrap().is_empty());
    backend.set(|f| &f.records_fail, false);
    clock.advance(Duration::from_secs(60));
    scheduler.wait_for(|s| s.seen >= Some(clock.now())).await;
    let recorded = backend.schedules().await.unwrap();
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        recorded[0].report.through,
        Some("2026-01-01T00:01:00Z".parse().unwrap())
    );
    scheduler.shutdown().await;
    drop(guard);
}

/// Waits `p["ms"]` milliseconds.
struct Sleeps;

impl Handler for Sleeps {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, p: Value) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(p["ms"].as_u64().unwrap_or(0))).await;
        Ok(())
    }
}

/// An outcome written while a claim is on its way back (the claim read the store before it)
/// may have freed room the claim did not see: the short claim is followed by another at once,
/// not at the next poll (an hour here).
#[tokio::test]
async fn an_outcome_written_during_a_claim_makes_the_next_claim_due() {
    use crate::{Admin, QueueLimits};
    let backend = Faulty::new();
    backend.set(|f| &f.slow_claims_no_wake, true);
    for (ms, key) in [(200, "p"), (100, "q"), (0, "p")] {
        let job = NewJob::from_value(json!({ "ms": ms })).partition_key(key);
        backend.inner.enqueue(job).await.unwrap();
    }
    let limits = QueueLimits {
        max_per_partition: Some(1),
        ..QueueLimits::NONE
    };
    backend.set_limits(limits).await.unwrap();
    let config = WorkerConfig {
        concurrency: 2,
        poll_interval: Duration::from_secs(3600),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(backend.clone(), Sleeps, config)
        .unwrap()
        .start();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(20), |s| s.completed == 3)
        .await
        .unwrap_or_else(|last| panic!("the last job waited for the poll: {last:?}"));
    worker.shutdown().await.unwrap();
    assert_eq!(stats.completed, 3);
}

/// A scheduler's shutdown is bounded when the store hangs in the middle of an enqueue.
#[tokio::test]
async fn a_scheduler_stops_when_the_store_hangs() {
    use crate::schedule::{ManualClock, Schedule, Scheduler};
    let backend = Faulty::new();
    backend.set(|f| &f.hang, true);
    let clock = ManualClock::new("2026-01-01T00:00:30Z".parse().unwrap());
    let scheduler = Scheduler::new(backend.clone())
        .schedule(Schedule::every("rates", Duration::from_secs(60)).unwrap())
        .unwrap()
        .clock(clock)
        .start()
        .unwrap();
    backend.faults.enqueue_called.notified().await;
    assert_eq!(backend.faults.enqueue_calls.load(Ordering::SeqCst), 1);
    tokio::time::timeout(Duration::from_secs(10), scheduler.shutdown())
        .await
        .expect("the shutdown waited on a hung store");
}
