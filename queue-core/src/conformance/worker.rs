//! The worker runtime on the backend: retries, failures, shutdown, poison jobs, hooks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;

use super::hooks::{Recorder, StageFollowUp};
use super::{Harness, claim, enqueue, lease, record};
use crate::backend::Backend;
use crate::error::BoxError;
use crate::handler::{CancelReason, Handler, JobContext, JobError};
use crate::hooks::{FinalizeEvent, FinalizeHook};
use crate::retry::RetryPolicy;
use crate::types::{CancelOutcome, JobId, JobStatus, Lease, NewJob};
use crate::worker::{Worker, WorkerConfig};

struct Gate {
    started: Arc<Notify>,
    open: Arc<Notify>,
}

impl Handler for Gate {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        self.started.notify_one();
        self.open.notified().await;
        Ok(())
    }
}

/// Fails the first run of every job whose `n` is odd, counting runs.
struct Flaky(Arc<Mutex<HashMap<i64, u32>>>);

impl Handler for Flaky {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, payload: Value) -> Result<(), JobError> {
        let n = payload["n"].as_i64().unwrap_or(0);
        let runs = {
            let mut runs = self.0.lock().unwrap();
            let r = runs.entry(n).or_insert(0);
            *r += 1;
            *r
        };
        if n % 2 == 1 && runs == 1 {
            return Err(JobError::retry("first run of an odd job fails"));
        }
        Ok(())
    }
}

fn quick_retries(max_attempts: u32) -> WorkerConfig {
    WorkerConfig {
        concurrency: 4,
        poll_interval: Duration::from_millis(20),
        retry: RetryPolicy {
            max_attempts,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            jitter: false,
        },
        ..WorkerConfig::default()
    }
}

struct AlwaysFails;

impl Handler for AlwaysFails {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        Err(JobError::retry("partner keeps failing"))
    }
}

#[derive(serde::Deserialize)]
struct Typed {
    #[allow(dead_code)]
    to: String,
}

struct NeverCalled(Arc<Mutex<u32>>);

impl Handler for NeverCalled {
    type Payload = Typed;
    async fn handle(&self, _ctx: JobContext, _payload: Typed) -> Result<(), JobError> {
        *self.0.lock().unwrap() += 1;
        Ok(())
    }
}

/// A long job that runs until its token fires, then reports why and gives up with a retryable
/// error.
struct StopsWhenCancelled {
    started: Arc<Notify>,
    reasons: Arc<Mutex<Vec<Option<CancelReason>>>>,
}

impl Handler for StopsWhenCancelled {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        self.started.notify_one();
        ctx.cancellation().cancelled().await;
        self.reasons.lock().unwrap().push(ctx.cancel_reason());
        Err(JobError::retry("stopped"))
    }
    fn runs_long(&self) -> bool {
        true
    }
}

/// A hook that refuses every outcome, named `always_refuses`.
struct AlwaysRefuses;

impl<Tx: Send, P: Sync> FinalizeHook<Tx, P> for AlwaysRefuses {
    fn name(&self) -> &str {
        "always_refuses"
    }
    async fn after_applied(
        &self,
        _tx: &mut Tx,
        _event: &FinalizeEvent<'_, P>,
    ) -> Result<(), BoxError> {
        Err("the domain store refuses".into())
    }
}

/// A hook that refuses the first outcome of every original job whose `n` is a multiple of
/// five, named `fails_once`.
#[derive(Default)]
struct FailsOnce(Mutex<HashSet<JobId>>);

impl<Tx: Send, P: Sync> FinalizeHook<Tx, P> for FailsOnce {
    fn name(&self) -> &str {
        "fails_once"
    }
    async fn after_applied(
        &self,
        _tx: &mut Tx,
        event: &FinalizeEvent<'_, P>,
    ) -> Result<(), BoxError> {
        let chosen = event.job.payload["n"].as_i64().is_some_and(|n| n % 5 == 0);
        if chosen && self.0.lock().unwrap().insert(event.job.id) {
            return Err("refused once".into());
        }
        Ok(())
    }
}

struct Noop;

impl Handler for Noop {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        Ok(())
    }
}

cases! {
    $ __conformance_worker;

    /// Graceful shutdown releases claimed-but-unstarted jobs at once (fenced), lets the running
    /// one finish, and strands nothing for a lease.
    pub async fn graceful_shutdown_releases_unstarted_claims<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let jobs: Vec<NewJob> = (0..4)
            .map(|n| NewJob::from_value(json!({ "n": n })))
            .collect();
        b.enqueue_many(jobs).await.unwrap();
        let started = Arc::new(Notify::new());
        let open = Arc::new(Notify::new());
        let config = WorkerConfig {
            concurrency: 1,
            prefetch: 3,
            max_batch: 4,
            ..WorkerConfig::default()
        };
        let handler = Gate {
            started: started.clone(),
            open: open.clone(),
        };
        let worker = Worker::new(b.clone(), handler, config).unwrap().start();
        started.notified().await;
        assert_eq!(
            worker.stats().claimed,
            4,
            "the worker should hold one running and three buffered"
        );
        worker.request_shutdown();
        worker.wait_for(|s| s.released == 3).await;
        open.notify_one();
        let report = worker.shutdown().await.unwrap();
        assert_eq!(report.released_unstarted, 3);
        assert_eq!(report.finished_in_time, 1);
        let counts = b.counts().await.unwrap();
        assert_eq!(
            (counts.completed, counts.pending, counts.in_flight),
            (1, 3, 0)
        );
        // Released jobs are claimable at once, their attempt not counted.
        let again = claim(b, 10).await.jobs;
        assert_eq!(again.len(), 3);
        assert!(again.iter().all(|j| j.attempts == 1 && j.reclaims == 0));
    }

    /// The worker buries a job it claims past the reclaim cap, without running it, and the hooks
    /// see the `Dead` write (so domain state and outbox follow the job to its end).
    pub async fn worker_ends_a_poison_job_dead_with_its_hooks<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        // Two workers died holding it.
        for _ in 0..2 {
            assert_eq!(claim(b, 1).await.jobs.len(), 1);
            h.advance_clock(lease().duration() + Duration::from_secs(1))
                .await;
        }
        let recorder = Recorder::default();
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let config = WorkerConfig {
            max_reclaims: 1,
            ..quick_retries(3)
        };
        let worker = Worker::new(b.clone(), Flaky(runs.clone()), config)
            .unwrap()
            .hook(recorder.clone())
            .start();
        let stats = worker.wait_for(|s| s.dead == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!(stats.completed, 0);
        assert!(
            runs.lock().unwrap().is_empty(),
            "a poison job must not run again"
        );
        assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "dead")]);
        assert_eq!(record(b, id).await.status, JobStatus::Dead);
    }

    /// The runtime end to end: every job completes, retried jobs exactly twice, no job runs again
    /// after completing.
    pub async fn worker_runs_jobs_to_completion_with_retries<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        const N: i64 = 40;
        b.enqueue_many(
            (0..N)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await
        .unwrap();
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let worker = Worker::new(b.clone(), Flaky(runs.clone()), quick_retries(3))
            .unwrap()
            .start();
        let stats = worker.wait_for(|s| s.completed == N as u64).await;
        worker.shutdown().await.unwrap();
        assert_eq!(stats.retried, (N / 2) as u64);
        assert_eq!(stats.stale, 0);
        let counts = b.counts().await.unwrap();
        assert_eq!(counts.completed, N as u64);
        let runs = runs.lock().unwrap();
        for n in 0..N {
            assert_eq!(runs[&n], if n % 2 == 1 { 2 } else { 1 }, "job {n}");
        }
    }

    /// Handler errors are bounded by `max_attempts`; then the job fails terminally with the error.
    pub async fn worker_fails_job_after_max_attempts<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let worker = Worker::new(b.clone(), AlwaysFails, quick_retries(3))
            .unwrap()
            .start();
        let stats = worker.wait_for(|s| s.failed == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!(stats.retried, 2);
        let rec = record(b, id).await;
        assert_eq!((rec.status, rec.attempts), (JobStatus::Failed, 3));
        let error = rec.last_error.unwrap_or_default();
        assert!(
            error.contains("partner keeps failing") && error.contains("gave up after 3"),
            "{error}"
        );
    }

    /// A payload that does not fit the handler's type fails terminally, keeping the payload.
    pub async fn worker_fails_malformed_payload_and_keeps_it<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = b
            .enqueue(NewJob::from_value(json!({ "to": 42 })))
            .await
            .unwrap()
            .id;
        let calls = Arc::new(Mutex::new(0));
        let worker = Worker::new(b.clone(), NeverCalled(calls.clone()), quick_retries(5))
            .unwrap()
            .start();
        worker.wait_for(|s| s.failed == 1).await;
        worker.shutdown().await.unwrap();
        assert_eq!(*calls.lock().unwrap(), 0);
        let rec = record(b, id).await;
        assert_eq!(rec.status, JobStatus::Failed);
        assert_eq!(
            rec.payload,
            json!({ "to": 42 }),
            "the payload must survive for inspection"
        );
        assert!(
            rec.last_error
                .unwrap_or_default()
                .starts_with("malformed payload")
        );
    }

    /// With hooks, the worker finalizes each job in a transaction the hooks share.
    pub async fn worker_runs_hooks_in_the_finalize_transaction<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let ids: Vec<JobId> = b
            .enqueue_many(
                (0..5)
                    .map(|n| NewJob::from_value(json!({ "n": n })))
                    .collect(),
            )
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.id)
            .collect();
        let recorder = Recorder::default();
        let worker = Worker::new(b.clone(), Noop, quick_retries(3))
            .unwrap()
            .hook(recorder.clone())
            .hook(StageFollowUp(b.clone()))
            .start();
        // Each original job stages one follow-up into the same queue; follow-ups stage nothing.
        worker.wait_for(|s| s.completed == 10).await;
        worker.shutdown().await.unwrap();
        let recorded: HashSet<JobId> = recorder
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(id, _)| *id)
            .collect();
        assert!(ids.iter().all(|id| recorded.contains(id)));
        for id in ids {
            assert_eq!(record(b, id).await.status, JobStatus::Completed);
        }
        let counts = b.counts().await.unwrap();
        assert_eq!(
            (counts.total(), counts.completed),
            (10, 10),
            "the staged follow-ups must commit"
        );
        assert_eq!(
            recorder.0.lock().unwrap().len(),
            10,
            "one hook run per applied finalize"
        );
    }

    /// With hooks, outcomes are written many to a transaction where the backend has
    /// savepoints: a hook that fails undoes only its own job's writes (here the follow-up its
    /// job staged before the failing hook ran), that job is written again alone, and every
    /// other job's writes commit. Each original job ends with exactly one follow-up.
    pub async fn a_failing_hook_costs_only_its_own_job_of_a_batch<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let originals: Vec<NewJob> = (0..20)
            .map(|n| NewJob::from_value(json!({ "n": n })))
            .collect();
        b.enqueue_many(originals).await.unwrap();
        let recorder = Recorder::default();
        let config = WorkerConfig {
            concurrency: 20,
            max_batch: 20,
            ..quick_retries(3)
        };
        let worker = Worker::new(b.clone(), Noop, config)
            .unwrap()
            .hook(StageFollowUp(b.clone()))
            .hook(FailsOnce::default())
            .hook(recorder.clone())
            .start();
        let stats = worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.completed == 40)
            .await
            .expect("every original and its follow-up complete");
        worker.shutdown().await.unwrap();
        assert_eq!((stats.dead, stats.finalize_errors, stats.stale), (0, 0, 0));
        let counts = b.counts().await.unwrap();
        assert_eq!(
            (counts.total(), counts.completed),
            (40, 40),
            "one follow-up per original: a refused try's follow-up was undone"
        );
        let recorded = recorder.0.lock().unwrap().clone();
        let distinct: HashSet<JobId> = recorded.iter().map(|(id, _)| *id).collect();
        assert_eq!((recorded.len(), distinct.len()), (40, 40));
    }

    /// A hook that keeps failing does not leave its job in flight forever: once the lease is
    /// nearly over the job is ended dead without the hooks, and `last_error` names the hook.
    pub async fn worker_ends_a_job_dead_when_a_hook_keeps_failing<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let config = WorkerConfig {
            lease: Lease::from_secs(3).unwrap(),
            job_timeout: Duration::from_secs(1),
            ..quick_retries(3)
        };
        let worker = Worker::new(b.clone(), Noop, config)
            .unwrap()
            .hook(AlwaysRefuses)
            .start();
        let stats = worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.dead == 1)
            .await
            .expect("the job ends dead");
        worker.shutdown().await.unwrap();
        assert_eq!((stats.completed, stats.finalize_errors), (0, 0));
        let rec = record(b, id).await;
        assert_eq!(rec.status, JobStatus::Dead);
        let error = rec.last_error.unwrap_or_default();
        assert!(error.contains("always_refuses"), "{error}");
    }

    /// An operator's cancel of a running long job reaches its handler at the next heartbeat
    /// (its token fires, [`CancelReason::CancelRequested`]); the error it then returns ends the
    /// job cancelled, with the hooks, instead of a retry.
    pub async fn worker_carries_out_a_cancel_requested_while_running<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let reasons = Arc::new(Mutex::new(Vec::new()));
        let started = Arc::new(Notify::new());
        let handler = StopsWhenCancelled {
            started: started.clone(),
            reasons: reasons.clone(),
        };
        let config = WorkerConfig {
            lease: Lease::from_secs(3).unwrap(),
            job_timeout: Duration::from_secs(60),
            ..quick_retries(3)
        };
        let recorder = Recorder::default();
        let worker = Worker::new(b.clone(), handler, config)
            .unwrap()
            .hook(recorder.clone())
            .start();
        started.notified().await;
        assert_eq!(b.cancel(id).await.unwrap(), CancelOutcome::Requested);
        let stats = worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.cancelled == 1)
            .await
            .expect("the holder ends the job cancelled");
        worker.shutdown().await.unwrap();
        assert_eq!(stats.retried, 0);
        assert_eq!(*reasons.lock().unwrap(), vec![Some(CancelReason::CancelRequested)]);
        assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "cancel")]);
        assert_eq!(record(b, id).await.status, JobStatus::Cancelled);
    }

    /// A job whose cancel was requested of a holder that then died is not run by the worker
    /// that takes it over: it ends it cancelled, with the hooks.
    pub async fn worker_ends_a_taken_over_job_with_a_cancel_request_without_running_it<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        // The first holder claims it, is asked to cancel, and dies before it learns of it.
        claim(b, 1).await;
        assert_eq!(b.cancel(id).await.unwrap(), CancelOutcome::Requested);
        h.advance_clock(lease().duration() + Duration::from_secs(1))
            .await;
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let recorder = Recorder::default();
        let worker = Worker::new(b.clone(), Flaky(runs.clone()), quick_retries(3))
            .unwrap()
            .hook(recorder.clone())
            .start();
        let stats = worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.cancelled == 1)
            .await
            .expect("the new holder ends the job cancelled");
        worker.shutdown().await.unwrap();
        assert_eq!(stats.retried, 0);
        assert!(runs.lock().unwrap().is_empty(), "the job was run");
        assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "cancel")]);
        let rec = record(b, id).await;
        assert_eq!(rec.status, JobStatus::Cancelled);
        assert_eq!(rec.last_error.as_deref(), Some(crate::CANCEL_REQUESTED_MESSAGE));
    }
}
