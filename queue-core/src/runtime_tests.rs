//! Runtime behaviour that is the core's own (the same for every backend): stale-fence events,
//! heartbeats and lease loss, timeouts, panics. Runs on the in-memory backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;
use tracing::instrument::WithSubscriber;

use crate::events::capture::Captured;
use crate::{
    Backend, ClaimRequest, Finalize, FinalizeOutcome, Handler, Heartbeat, Hooks, JobContext,
    JobError, JobStatus, Lease, MemoryBackend, NewJob, RetryPolicy, Worker, WorkerConfig,
    finalize_with_hooks,
};

fn no_backoff(config: WorkerConfig) -> WorkerConfig {
    WorkerConfig {
        poll_interval: Duration::from_millis(10),
        retry: RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            jitter: false,
        },
        ..config
    }
}

#[tokio::test]
async fn a_stale_finalize_emits_the_fenced_event_with_its_fields() {
    let captured = Captured::default();
    async {
        let queue = MemoryBackend::new();
        queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
        let lease = Lease::from_secs(10).unwrap();
        let old = queue
            .claim(ClaimRequest::new(1, lease))
            .await
            .unwrap()
            .jobs
            .remove(0);
        queue.advance_clock(Duration::from_secs(11));
        let _new = queue
            .claim(ClaimRequest::new(1, lease))
            .await
            .unwrap()
            .jobs
            .remove(0);
        let outcome =
            finalize_with_hooks(&queue, &Hooks::<_, Value>::new(), &old, &Finalize::Complete)
                .await
                .unwrap();
        assert_eq!(outcome, FinalizeOutcome::Stale);
    }
    .with_subscriber(captured.subscriber())
    .await;
    assert_eq!(captured.count(crate::events::STALE_FINALIZE_FENCED), 1);
}

/// Blocks until its lease is lost, then reports whether the token fired.
struct WaitsForLeaseLoss {
    started: Arc<Notify>,
    saw_cancel: Arc<AtomicU32>,
}

impl Handler for WaitsForLeaseLoss {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, _p: Value) -> Result<(), JobError> {
        self.started.notify_one();
        ctx.cancellation().cancelled().await;
        self.saw_cancel.fetch_add(1, Ordering::SeqCst);
        Err(JobError::retry("stopped: lease lost"))
    }
    fn runs_long(&self) -> bool {
        true
    }
}

#[tokio::test(start_paused = true)]
async fn heartbeat_finds_the_lease_lost_cancels_the_handler_and_the_write_is_fenced() {
    let captured = Captured::default();
    // A current-thread runtime runs the worker's tasks on this thread, so a thread-local
    // subscriber sees their events.
    let guard = tracing::subscriber::set_default(captured.subscriber());
    {
        let queue = MemoryBackend::new();
        let id = queue
            .enqueue(NewJob::from_value(json!({})))
            .await
            .unwrap()
            .id;
        let started = Arc::new(Notify::new());
        let saw_cancel = Arc::new(AtomicU32::new(0));
        let lease = Lease::from_secs(30).unwrap();
        let config = WorkerConfig {
            lease,
            job_timeout: Duration::from_secs(3600),
            ..no_backoff(WorkerConfig::default())
        };
        let handler = WaitsForLeaseLoss {
            started: started.clone(),
            saw_cancel: saw_cancel.clone(),
        };
        let worker = Worker::new(queue.clone(), handler, config).unwrap().start();
        started.notified().await;
        // Another worker takes the job over after the (backend) clock passed the lease.
        queue.advance_clock(Duration::from_secs(31));
        let thief = queue
            .claim(ClaimRequest::new(1, lease))
            .await
            .unwrap()
            .jobs
            .remove(0);
        assert_eq!(thief.id, id);
        // The next heartbeat (every lease / 3 of tokio time) comes back stale.
        let stats = worker.wait_for(|s| s.stale == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!(
            saw_cancel.load(Ordering::SeqCst),
            1,
            "the handler was not told"
        );
        assert_eq!(stats.retried, 0, "the stale holder's retry must not apply");
        let row = queue.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, JobStatus::InFlight);
        assert_eq!(row.claim_generation, thief.generation);
    }
    drop(guard);
    assert_eq!(captured.count(crate::events::LEASE_LOST), 1);
    assert_eq!(captured.count(crate::events::STALE_FINALIZE_FENCED), 1);
}

#[tokio::test]
async fn heartbeat_keeps_a_long_job_past_its_lease() {
    // Real (unpaused) time is not needed: the heartbeat is what the test checks, through the
    // backend clock. Claim, heartbeat via the runtime's own API, and see no takeover.
    let queue = MemoryBackend::new();
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    let lease = Lease::from_secs(30).unwrap();
    let job = queue
        .claim(ClaimRequest::new(1, lease))
        .await
        .unwrap()
        .jobs
        .remove(0);
    for _ in 0..5 {
        queue.advance_clock(Duration::from_secs(20));
        assert!(
            queue
                .extend_lease(job.claim(), Lease::DEFAULT)
                .await
                .unwrap()
                == Heartbeat::Held
        );
        assert!(
            queue
                .claim(ClaimRequest::new(1, lease))
                .await
                .unwrap()
                .jobs
                .is_empty()
        );
    }
}

struct Sleeps;

impl Handler for Sleeps {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_run_past_the_job_timeout_counts_as_a_handler_error() {
    let captured = Captured::default();
    // A current-thread runtime runs the worker's tasks on this thread, so a thread-local
    // subscriber sees their events.
    let guard = tracing::subscriber::set_default(captured.subscriber());
    {
        let queue = MemoryBackend::new();
        let id = queue
            .enqueue(NewJob::from_value(json!({})))
            .await
            .unwrap()
            .id;
        let config = WorkerConfig {
            job_timeout: Duration::from_secs(5),
            ..no_backoff(WorkerConfig::default())
        };
        let config = WorkerConfig {
            retry: RetryPolicy {
                max_attempts: 2,
                ..config.retry
            },
            ..config
        };
        let worker = Worker::new(queue.clone(), Sleeps, config).unwrap().start();
        let stats = worker.wait_for(|s| s.failed == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!(stats.retried, 1);
        let row = queue.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, JobStatus::Failed);
        assert!(row.last_error.unwrap().contains("timed out"));
    }
    drop(guard);
    assert_eq!(captured.count(crate::events::HANDLER_TIMED_OUT), 2);
}

struct Panics(Arc<AtomicU32>);

impl Handler for Panics {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            panic!("handler bug");
        }
        Ok(())
    }
}

#[tokio::test]
async fn a_panicking_handler_is_retried_not_stranded() {
    let queue = MemoryBackend::new();
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let runs = Arc::new(AtomicU32::new(0));
    let worker = Worker::new(
        queue.clone(),
        Panics(runs.clone()),
        no_backoff(WorkerConfig::default()),
    )
    .unwrap()
    .start();
    let stats = worker.wait_for(|s| s.completed == 1).await;
    worker.shutdown().await.unwrap();
    assert_eq!((stats.retried, runs.load(Ordering::SeqCst)), (1, 2));
    let row = queue.get(id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Completed);
    assert!(row.last_error.unwrap().contains("panicked"));
}

struct Stubborn;

impl Handler for Stubborn {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        // Ignores its cancellation token.
        std::future::pending::<()>().await;
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn shutdown_aborts_handlers_past_the_deadline_and_releases_their_jobs() {
    let queue = MemoryBackend::new();
    queue
        .enqueue_many(
            (0..2)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await
        .unwrap();
    let config = WorkerConfig {
        concurrency: 2,
        shutdown_timeout: Duration::from_secs(2),
        shutdown_grace: Duration::from_secs(1),
        ..no_backoff(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), Stubborn, config)
        .unwrap()
        .start();
    worker.wait_for(|s| s.started == 2).await;
    let report = worker.shutdown().await.unwrap();
    assert_eq!((report.aborted, report.finished_in_time), (2, 0));
    let counts = queue.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight),
        (2, 0),
        "aborted jobs must not wait for a lease"
    );
}

#[tokio::test]
async fn a_worker_wakes_on_enqueue_without_waiting_for_the_poll() {
    let queue = MemoryBackend::new();
    let config = WorkerConfig {
        poll_interval: Duration::from_secs(3600),
        ..WorkerConfig::default()
    };
    struct Done;
    impl Handler for Done {
        type Payload = Value;
        async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
            Ok(())
        }
    }
    let worker = Worker::new(queue.clone(), Done, config).unwrap().start();
    // Let the worker make its first (empty) claim and go idle on an hour-long poll.
    tokio::task::yield_now().await;
    queue.enqueue(NewJob::from_value(json!({}))).await.unwrap();
    // Within the test's default timeout this only finishes if the wake-up works.
    tokio::time::timeout(
        Duration::from_secs(10),
        worker.wait_for(|s| s.completed == 1),
    )
    .await
    .expect("the enqueue did not wake the idle worker");
    worker.shutdown().await.unwrap();
}

#[tokio::test]
async fn worker_refuses_a_lease_below_twice_the_timeout() {
    let config = WorkerConfig {
        lease: Lease::from_secs(40).unwrap(),
        job_timeout: Duration::from_secs(30),
        ..WorkerConfig::default()
    };
    struct Quick;
    impl Handler for Quick {
        type Payload = Value;
        async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
            Ok(())
        }
    }
    let err = Worker::new(MemoryBackend::new(), Quick, config)
        .err()
        .expect("refused");
    assert!(matches!(
        err,
        crate::Error::Config(crate::ConfigError::LeaseTooShortForTimeout { .. })
    ));
}

#[tokio::test]
async fn memory_tx_undoes_in_place_writes_on_rollback_only() {
    use crate::BackendTx;
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let queue = MemoryBackend::new();
    for commit in [false, true] {
        let mut tx = queue.begin().await.unwrap();
        let (undo, done) = (log.clone(), log.clone());
        tx.on_rollback(move || undo.lock().unwrap().push(format!("undo {commit}")));
        tx.on_commit(move || done.lock().unwrap().push(format!("commit {commit}")));
        if commit {
            tx.commit().await.unwrap();
        } else {
            drop(tx); // dropped uncommitted = rolled back
        }
    }
    assert_eq!(*log.lock().unwrap(), vec!["undo false", "commit true"]);
}

struct ReportsLease(Arc<std::sync::Mutex<Option<Duration>>>);

impl Handler for ReportsLease {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, _p: Value) -> Result<(), JobError> {
        *self.0.lock().unwrap() = Some(ctx.lease_remaining());
        Err(JobError::release("not now"))
    }
}

#[tokio::test]
async fn handlers_see_the_lease_left_and_can_release_without_counting_an_attempt() {
    let queue = MemoryBackend::new();
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let seen = Arc::new(std::sync::Mutex::new(None));
    let worker = Worker::new(
        queue.clone(),
        ReportsLease(seen.clone()),
        no_backoff(WorkerConfig::default()),
    )
    .unwrap()
    .start();
    worker.wait_for(|s| s.released >= 1).await;
    worker.shutdown().await.unwrap();
    let left = seen.lock().unwrap().expect("the handler ran");
    assert!(
        left <= Lease::DEFAULT.duration() && left > Duration::from_secs(80),
        "{left:?}"
    );
    let row = queue.get(id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Pending);
    assert_eq!(row.attempts, 0, "a release must give the attempt back");
}

/// Two slow jobs eat most of the lease; the job prefetched behind them must not start with less
/// lease left than a full run could need.
struct SlowFirst(Arc<AtomicU32>);

impl Handler for SlowFirst {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, payload: Value) -> Result<(), JobError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        if payload["n"] != 2 {
            tokio::time::sleep(Duration::from_secs(25)).await;
        }
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_prefetched_job_with_too_little_lease_left_is_released_not_started() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = MemoryBackend::new();
    queue
        .enqueue_many(
            (0..3)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let config = WorkerConfig {
        concurrency: 1,
        prefetch: 2,
        lease: Lease::from_secs(60).unwrap(),
        job_timeout: Duration::from_secs(29),
        ..no_backoff(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), SlowFirst(runs.clone()), config)
        .unwrap()
        .start();
    let stats = worker.wait_for(|s| s.completed == 3).await;
    worker.shutdown().await.unwrap();
    drop(guard);
    // 50 s into a 60 s lease, 10 s were left for a job allowed 29: released, claimed afresh.
    assert!(stats.released >= 1, "{stats:?}");
    assert_eq!(stats.retried, 0, "{stats:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 3, "each job ran exactly once");
    assert!(captured.count(crate::events::CLAIM_RELEASED) >= 1);
    let counts = queue.counts().await.unwrap();
    assert_eq!(counts.completed, 3);
}

/// Fails its first `n` runs, then lets the finalize through.
struct FlakyHook(Arc<AtomicU32>, u32);

impl crate::FinalizeHook<crate::MemoryTx, Value> for FlakyHook {
    async fn after_applied(
        &self,
        _tx: &mut crate::MemoryTx,
        _event: &crate::FinalizeEvent<'_, Value>,
    ) -> Result<(), crate::BoxError> {
        if self.0.fetch_add(1, Ordering::SeqCst) < self.1 {
            return Err("the outbox table is locked".into());
        }
        Ok(())
    }
}

struct Quick;

impl Handler for Quick {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _p: Value) -> Result<(), JobError> {
        Ok(())
    }
}

/// Outcomes whose hooks keep failing do not let the worker claim without end: while as many
/// outcomes wait as the worker has slots, a finishing job keeps its slot, so the jobs in
/// flight never exceed twice the worker's slots (3 here: concurrency 2, prefetch 1).
#[tokio::test(start_paused = true)]
async fn outcomes_whose_hooks_keep_failing_hold_the_workers_slots() {
    let queue = MemoryBackend::new();
    let jobs = (0..40)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    queue.enqueue_many(jobs).await.unwrap();
    let config = WorkerConfig {
        concurrency: 2,
        prefetch: 1,
        ..no_backoff(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), Quick, config)
        .unwrap()
        .hook(FlakyHook(Arc::new(AtomicU32::new(0)), u32::MAX))
        .start();
    worker.wait_for(|s| s.started >= 3).await;
    // Hook retries run on a schedule of seconds: let many of them pass.
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let counts = queue.counts().await.unwrap();
        assert!(counts.in_flight <= 6, "{counts:?}");
    }
    assert!(worker.stats().started <= 6, "{:?}", worker.stats());
    worker.request_shutdown();
}

/// A job whose outcome is still being tried alone when shutdown's time runs out is given back
/// (released, its attempt uncounted), not left in flight for its lease.
#[tokio::test(start_paused = true)]
async fn an_outcome_still_unwritten_at_the_shutdown_deadline_is_released() {
    let queue = MemoryBackend::new();
    let id = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let calls = Arc::new(AtomicU32::new(0));
    let config = WorkerConfig {
        shutdown_timeout: Duration::from_secs(2),
        shutdown_grace: Duration::from_secs(2),
        ..no_backoff(WorkerConfig::default())
    };
    let worker = Worker::new(queue.clone(), Quick, config)
        .unwrap()
        .hook(FlakyHook(calls.clone(), u32::MAX))
        .start();
    worker.wait_for(|s| s.started == 1).await;
    while calls.load(Ordering::SeqCst) < 3 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let report = worker.shutdown().await.unwrap();
    assert_eq!(report.stats.released, 1, "{report:?}");
    let row = queue.get(id).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts), (JobStatus::Pending, 0));
}

#[tokio::test(start_paused = true)]
async fn a_failing_finalize_is_tried_again_and_a_hook_that_keeps_failing_ends_the_job_dead() {
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.subscriber());
    let queue = MemoryBackend::new();
    let passes = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    // Two failures, then success: the third attempt applies.
    let calls = Arc::new(AtomicU32::new(0));
    let worker = Worker::new(queue.clone(), Quick, no_backoff(WorkerConfig::default()))
        .unwrap()
        .hook(FlakyHook(calls.clone(), 2))
        .start();
    let stats = worker.wait_for(|s| s.completed == 1).await;
    worker.shutdown().await.unwrap();
    assert_eq!(
        (stats.finalize_errors, calls.load(Ordering::SeqCst)),
        (0, 3)
    );
    assert_eq!(captured.count(crate::events::FINALIZE_RETRY), 2);
    assert_eq!(
        queue.get(passes).await.unwrap().unwrap().status,
        JobStatus::Completed
    );

    // Always failing: tried again until the lease is nearly over, then the job is ended dead
    // without the hooks (no job stays in flight forever), the hook named.
    let stuck = queue
        .enqueue(NewJob::from_value(json!({})))
        .await
        .unwrap()
        .id;
    let worker = Worker::new(queue.clone(), Quick, no_backoff(WorkerConfig::default()))
        .unwrap()
        .hook(FlakyHook(Arc::new(AtomicU32::new(0)), u32::MAX))
        .start();
    let stats = worker.wait_for(|s| s.dead == 1).await;
    worker.shutdown().await.unwrap();
    drop(guard);
    assert_eq!((stats.completed, stats.finalize_errors), (0, 0));
    assert_eq!(captured.count(crate::events::HOOK_GAVE_UP), 1);
    let row = queue.get(stuck).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Dead);
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains("FlakyHook"), "{error}");
}
