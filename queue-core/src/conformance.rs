//! The backend conformance suite: the executable form of the [`Backend`] guarantees.
//!
//! Every backend runs the same cases from its own tests with one macro call, which expands to one
//! named `#[test]` per case so a failure names the broken guarantee:
//!
//! ```ignore
//! // tests/conformance.rs of a backend crate
//! queue_core::conformance_suite!(my_backend_tests::Harness);
//! ```
//!
//! A [`Harness`] gives each case a fresh, empty queue and a way to move the backend's clock
//! (leases expire by moving time, never by sleeping). Changing the queue's semantics means
//! extending this suite, not adding a backend-only test.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DurationRound, TimeDelta, Utc};
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::backend::{Backend, BackendTx};
use crate::error::{BoxError, Error};
use crate::handler::{Handler, JobContext, JobError};
use crate::hooks::{FinalizeEvent, FinalizeHook, Hooks, finalize_with_hooks};
use crate::retry::RetryPolicy;
use crate::types::{
    CancelOutcome, ClaimBatch, ClaimGeneration, ClaimRequest, Finalize, FinalizeOutcome, JobId,
    JobRecord, JobStatus, Lease, NewJob, RunAt,
};
use crate::worker::{Worker, WorkerConfig};

/// What a backend's test crate provides to run the suite.
pub trait Harness: Send + Sync + Sized + 'static {
    /// The backend under test.
    type Backend: Backend;

    /// A fresh, empty queue (a scratch database, a new store): cases never share state.
    fn setup() -> impl Future<Output = Self> + Send;

    /// The queue under test. Clones must share the store (several clones stand for several
    /// workers or connections).
    fn backend(&self) -> &Self::Backend;

    /// Moves the backend's clock forward by `by`: a lease claimed `by` earlier must now count as
    /// that much older, and a job due `by` from now must be due. (A SQL backend may move stored
    /// timestamps back instead.)
    fn advance_clock(&self, by: Duration) -> impl Future<Output = ()> + Send;

    /// Inserts a legacy row: `in_flight` with no `claimed_at`, generation 0, `attempts` 1, due
    /// an hour ago: what a pre-lease release leaves behind.
    fn insert_legacy_in_flight(&self, payload: Value) -> impl Future<Output = JobId> + Send;

    /// Releases what `setup` created. Runs even when the case failed.
    fn teardown(&self) -> impl Future<Output = ()> + Send;
}

/// Runs one case on a fresh harness inside its own multi-threaded runtime, tears down, and then
/// re-raises the case's panic if it had one.
pub fn run_case<H, F, Fut>(case: F)
where
    H: Harness,
    F: FnOnce(Arc<H>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .expect("a tokio runtime for the conformance case");
    runtime.block_on(async move {
        let harness = Arc::new(H::setup().await);
        let outcome = tokio::spawn(case(harness.clone())).await;
        harness.teardown().await;
        if let Err(err) = outcome {
            if err.is_panic() {
                std::panic::resume_unwind(err.into_panic());
            }
            panic!("conformance case did not finish: {err}");
        }
    });
}

/// Expands to one `#[test]` per conformance case for the given [`Harness`] type.
#[macro_export]
macro_rules! conformance_suite {
    ($harness:ty) => {
        $crate::conformance_suite!(@cases $harness;
            fresh_claim_from_overdue_backlog_is_not_reclaimable,
            expired_lease_is_reclaimed_with_next_generation,
            stale_complete_is_fenced_and_new_generation_applies,
            stale_fail_terminal_cannot_overwrite_completed,
            stale_retry_cannot_yank_active_claim,
            hooks_run_only_after_applied,
            hook_error_rolls_back_the_whole_finalize,
            racing_claims_take_each_job_once,
            racing_reclaims_take_each_expired_job_once,
            legacy_in_flight_without_claimed_at_is_reclaimable_at_once,
            extend_lease_is_fenced_and_postpones_expiry,
            claim_order_is_next_attempt_then_priority,
            graceful_shutdown_releases_unstarted_claims,
            reclaim_cap_flags_a_poison_job_and_burying_ends_it_dead,
            worker_buries_a_poison_job_with_its_hooks,
            release_keeps_place_and_uncounts_the_attempt,
            retry_at_schedules_and_counts_a_handler_error,
            cancel_only_touches_pending_jobs,
            unique_key_enqueues_once,
            enqueue_in_is_atomic_with_the_transaction,
            enqueue_many_keeps_input_order,
            finalize_many_fences_each_item,
            worker_runs_jobs_to_completion_with_retries,
            worker_fails_job_after_max_attempts,
            worker_fails_malformed_payload_and_keeps_it,
            worker_runs_hooks_in_the_finalize_transaction,
            counts_and_get_report_this_queue_only,
        );
    };
    (@cases $harness:ty; $($case:ident),+ $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::conformance::run_case::<$harness, _, _>(|h| $crate::conformance::$case(h));
            }
        )+
    };
}

fn lease() -> Lease {
    Lease::DEFAULT
}

fn req(batch: u32) -> ClaimRequest {
    ClaimRequest::new(batch, lease())
}

async fn claim<B: Backend>(backend: &B, batch: u32) -> ClaimBatch {
    backend.claim(req(batch)).await.expect("claim")
}

async fn enqueue<B: Backend>(backend: &B, n: i64) -> JobId {
    backend
        .enqueue(NewJob::from_value(json!({ "n": n })))
        .await
        .expect("enqueue")
        .id
}

async fn record<B: Backend>(backend: &B, id: JobId) -> JobRecord {
    backend
        .get(id)
        .await
        .expect("get")
        .unwrap_or_else(|| panic!("job {id} is missing"))
}

/// Claims `id` once (fresh), expires the lease, claims it again: returns both claims' jobs.
async fn claim_then_take_over<H: Harness>(
    h: &H,
    id: JobId,
) -> (crate::ClaimedJob, crate::ClaimedJob) {
    let first = claim(h.backend(), 1).await.jobs.remove(0);
    assert_eq!(first.id, id);
    h.advance_clock(lease().duration() + Duration::from_secs(1))
        .await;
    let second = claim(h.backend(), 1).await.jobs.remove(0);
    assert_eq!(second.id, id, "the expired job must be the one re-claimed");
    (first, second)
}

/// (1) A job claimed out of an overdue backlog keeps its lease: the claim clock is `claimed_at`,
/// not `next_attempt_at` (the seed's wrong-clock defect).
pub async fn fresh_claim_from_overdue_backlog_is_not_reclaimable<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let ancient = Utc::now() - TimeDelta::days(3);
    let id = b
        .enqueue(NewJob::from_value(json!({})).run_at(RunAt::At(ancient)))
        .await
        .unwrap()
        .id;
    let first = claim(b, 10).await;
    assert_eq!(first.jobs.len(), 1);
    assert_eq!(first.jobs[0].id, id);
    assert_eq!(first.jobs[0].generation, ClaimGeneration(1));
    assert!(
        claim(b, 10).await.jobs.is_empty(),
        "a live lease was stolen"
    );
    // Most of the lease gone, still held.
    h.advance_clock(lease().duration() - Duration::from_secs(10))
        .await;
    assert!(
        claim(b, 10).await.jobs.is_empty(),
        "a live lease was stolen late in its life"
    );
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::InFlight);
    assert_eq!(rec.claim_generation, ClaimGeneration(1));
}

/// (2) An expired lease is taken over: generation + 1, attempts + 1, `claimed_at` refreshed.
pub async fn expired_lease_is_reclaimed_with_next_generation<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let first = claim(b, 1).await.jobs.remove(0);
    h.advance_clock(lease().duration() + Duration::from_secs(1))
        .await;
    let aged = record(b, id).await.claimed_at.expect("claimed_at stamped");
    let second = claim(b, 1).await.jobs.remove(0);
    assert_eq!(second.id, id);
    assert_eq!(second.generation.0, first.generation.0 + 1);
    assert_eq!(second.attempts, first.attempts + 1);
    assert_eq!(second.reclaims, 1);
    assert!(second.claimed_at > aged, "claimed_at was not refreshed");
    let rec = record(b, id).await;
    assert_eq!(rec.claimed_at, Some(second.claimed_at));
    assert_eq!(rec.claim_generation, second.generation);
    assert_eq!(rec.status, JobStatus::InFlight);
}

/// (3) The old holder's complete is fenced; the job stays in flight under the new generation,
/// whose complete then applies.
pub async fn stale_complete_is_fenced_and_new_generation_applies<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let (old, new) = claim_then_take_over(&*h, id).await;
    assert_eq!(
        b.finalize(old.claim(), &Finalize::Complete).await.unwrap(),
        FinalizeOutcome::Stale
    );
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::InFlight);
    assert_eq!(rec.claim_generation, new.generation);
    assert_eq!(
        b.finalize(new.claim(), &Finalize::Complete).await.unwrap(),
        FinalizeOutcome::Applied
    );
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::Completed);
    assert!(rec.finished_at.is_some());
}

/// (4) The seed's named defect: a stale terminal failure overwriting a completed job.
pub async fn stale_fail_terminal_cannot_overwrite_completed<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let (old, new) = claim_then_take_over(&*h, id).await;
    assert!(
        b.finalize(new.claim(), &Finalize::Complete)
            .await
            .unwrap()
            .is_applied()
    );
    let stale = Finalize::FailTerminal {
        error: "partner said 500".into(),
    };
    assert_eq!(
        b.finalize(old.claim(), &stale).await.unwrap(),
        FinalizeOutcome::Stale
    );
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::Completed);
    assert_eq!(rec.last_error, None);
}

/// (5) A status-only guard is not enough: the job is in flight, just not for this holder.
pub async fn stale_retry_cannot_yank_active_claim<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let (old, new) = claim_then_take_over(&*h, id).await;
    let retry = Finalize::RetryAt {
        at: RunAt::Now,
        error: "timeout".into(),
    };
    assert_eq!(
        b.finalize(old.claim(), &retry).await.unwrap(),
        FinalizeOutcome::Stale
    );
    assert_eq!(
        b.finalize(old.claim(), &Finalize::Release).await.unwrap(),
        FinalizeOutcome::Stale
    );
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::InFlight);
    assert_eq!(rec.claim_generation, new.generation);
    assert!(
        claim(b, 10).await.jobs.is_empty(),
        "the active claim was yanked back to pending"
    );
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(JobId, &'static str)>>>);

#[async_trait]
impl<B: Backend> FinalizeHook<B> for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    async fn after_applied(
        &self,
        _tx: &mut B::Tx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        self.0
            .lock()
            .unwrap()
            .push((event.job.id, event.action.kind()));
        Ok(())
    }
}

/// Stages a follow-up job (for original jobs only) into the same transaction: the shape of an
/// outbox stager.
struct StageFollowUp<B: Backend>(B);

#[async_trait]
impl<B: Backend> FinalizeHook<B> for StageFollowUp<B> {
    fn name(&self) -> &str {
        "stage_follow_up"
    }
    async fn after_applied(
        &self,
        tx: &mut B::Tx,
        event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        if event.job.payload.get("follow_up_of").is_none() {
            let follow_up = NewJob::from_value(json!({ "follow_up_of": event.job.id.0 }));
            self.0.enqueue_in(tx, follow_up).await?;
        }
        Ok(())
    }
}

struct Refuse;

#[async_trait]
impl<B: Backend> FinalizeHook<B> for Refuse {
    fn name(&self) -> &str {
        "refuse"
    }
    async fn after_applied(
        &self,
        _tx: &mut B::Tx,
        _event: &FinalizeEvent<'_>,
    ) -> Result<(), BoxError> {
        Err("domain guard refused".into())
    }
}

/// (6a) Hooks run after Applied only, in order, once.
pub async fn hooks_run_only_after_applied<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let (old, new) = claim_then_take_over(&*h, id).await;
    let recorder = Recorder::default();
    let hooks = Hooks::new()
        .with(recorder.clone())
        .with(StageFollowUp(b.clone()));
    let stale = finalize_with_hooks(b, &hooks, &old, &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(stale, FinalizeOutcome::Stale);
    assert!(recorder.0.lock().unwrap().is_empty(), "a hook ran on Stale");
    assert_eq!(
        b.counts().await.unwrap().total(),
        1,
        "a stale finalize staged a side effect"
    );

    let applied = finalize_with_hooks(b, &hooks, &new, &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(applied, FinalizeOutcome::Applied);
    assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "complete")]);
    let counts = b.counts().await.unwrap();
    assert_eq!(
        (counts.completed, counts.pending),
        (1, 1),
        "the staged follow-up must commit"
    );
}

/// (6b) A failing hook rolls back the fenced write and every earlier hook's writes.
pub async fn hook_error_rolls_back_the_whole_finalize<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let job = claim(b, 1).await.jobs.remove(0);
    let failing = Hooks::new().with(StageFollowUp(b.clone())).with(Refuse);
    let err = finalize_with_hooks(b, &failing, &job, &Finalize::Complete)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Hook { hook, .. } if hook == "refuse"),
        "{err}"
    );
    let rec = record(b, id).await;
    assert_eq!(
        rec.status,
        JobStatus::InFlight,
        "the fenced write survived a hook error"
    );
    assert_eq!(rec.claim_generation, job.generation);
    assert_eq!(
        b.counts().await.unwrap().total(),
        1,
        "an earlier hook's write survived"
    );
    // The claim is intact: the same holder finalizes once the hooks are fine.
    let fine = Hooks::new().with(StageFollowUp(b.clone()));
    let outcome = finalize_with_hooks(b, &fine, &job, &Finalize::Complete)
        .await
        .unwrap();
    assert_eq!(outcome, FinalizeOutcome::Applied);
    assert_eq!(b.counts().await.unwrap().total(), 2);
}

async fn race_claims<B: Backend>(
    backend: &B,
    tasks: usize,
    batch: u32,
) -> Vec<(JobId, ClaimGeneration)> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let b = backend.clone();
        set.spawn(async move {
            let mut got = Vec::new();
            let mut empty_in_a_row = 0;
            while empty_in_a_row < 2 {
                let jobs = claim(&b, batch).await.jobs;
                assert!(
                    jobs.len() <= batch as usize,
                    "a claim returned more than its batch"
                );
                if jobs.is_empty() {
                    empty_in_a_row += 1;
                }
                got.extend(jobs.iter().map(|j| (j.id, j.generation)));
            }
            got
        });
    }
    let mut all = Vec::new();
    while let Some(got) = set.join_next().await {
        all.extend(got.expect("claim task"));
    }
    all
}

/// (7) Several tasks race claims over M jobs: each job is taken exactly once, none is lost.
pub async fn racing_claims_take_each_job_once<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    const M: usize = 300;
    let jobs: Vec<NewJob> = (0..M)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    let ids: HashSet<JobId> = b
        .enqueue_many(jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.id)
        .collect();
    let taken = race_claims(b, 8, 7).await;
    let mut seen = HashMap::new();
    for (id, generation) in &taken {
        assert_eq!(*generation, ClaimGeneration(1));
        *seen.entry(*id).or_insert(0) += 1;
    }
    assert!(seen.values().all(|n| *n == 1), "a job was claimed twice");
    assert_eq!(
        seen.keys().copied().collect::<HashSet<_>>(),
        ids,
        "a job was lost"
    );
    assert_eq!(b.counts().await.unwrap().in_flight, M as u64);
}

/// (7b) The same race over expired leases: each is taken over exactly once, at generation 2.
pub async fn racing_reclaims_take_each_expired_job_once<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    const M: usize = 120;
    let jobs: Vec<NewJob> = (0..M)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    b.enqueue_many(jobs).await.unwrap();
    assert_eq!(claim(b, M as u32).await.jobs.len(), M);
    h.advance_clock(lease().duration() + Duration::from_secs(1))
        .await;
    let taken = race_claims(b, 8, 5).await;
    assert_eq!(
        taken.len(),
        M,
        "each expired job must be taken over exactly once"
    );
    let distinct: HashSet<JobId> = taken.iter().map(|(id, _)| *id).collect();
    assert_eq!(distinct.len(), M);
    assert!(taken.iter().all(|(_, g)| *g == ClaimGeneration(2)));
}

/// (8) A legacy row (in flight, no `claimed_at`) counts as expired: re-claimable at once.
pub async fn legacy_in_flight_without_claimed_at_is_reclaimable_at_once<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = h.insert_legacy_in_flight(json!({ "legacy": true })).await;
    let before = record(b, id).await;
    assert_eq!(
        (before.status, before.claimed_at),
        (JobStatus::InFlight, None)
    );
    let job = claim(b, 5).await.jobs.remove(0);
    assert_eq!(job.id, id);
    assert_eq!(job.generation.0, before.claim_generation.0 + 1);
    assert_eq!(job.attempts, before.attempts + 1);
    assert_eq!(job.payload, json!({ "legacy": true }));
    assert!(record(b, id).await.claimed_at.is_some());
}

/// (9) The heartbeat is fenced like a finalizer, and it restarts the lease.
pub async fn extend_lease_is_fenced_and_postpones_expiry<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let job = claim(b, 1).await.jobs.remove(0);
    h.advance_clock(Duration::from_secs(60)).await;
    assert_eq!(
        b.extend_lease(job.claim()).await.unwrap(),
        FinalizeOutcome::Applied
    );
    h.advance_clock(Duration::from_secs(60)).await;
    // 120 s since the claim, 60 s since the heartbeat: still held.
    assert!(
        claim(b, 1).await.jobs.is_empty(),
        "the heartbeat did not restart the lease"
    );
    h.advance_clock(Duration::from_secs(31)).await;
    let taken = claim(b, 1).await.jobs.remove(0);
    assert_eq!(taken.id, id);
    assert_eq!(
        b.extend_lease(job.claim()).await.unwrap(),
        FinalizeOutcome::Stale
    );
    assert_eq!(
        b.extend_lease(taken.claim()).await.unwrap(),
        FinalizeOutcome::Applied
    );
}

/// (10) Claim order: `next_attempt_at`, then priority (lower first); future jobs wait.
pub async fn claim_order_is_next_attempt_then_priority<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let t0 = Utc::now().duration_trunc(TimeDelta::seconds(1)).unwrap() - TimeDelta::minutes(10);
    let at = |offset_s: i64, priority: i16| {
        NewJob::from_value(json!({}))
            .run_at(RunAt::At(t0 + TimeDelta::seconds(offset_s)))
            .priority(priority)
    };
    let late_low = b.enqueue(at(0, 5)).await.unwrap().id;
    let late_high = b.enqueue(at(0, -1)).await.unwrap().id;
    let earliest = b.enqueue(at(-60, 9)).await.unwrap().id;
    let late_mid = b.enqueue(at(0, 0)).await.unwrap().id;
    let future = b
        .enqueue(NewJob::from_value(json!({})).run_at(RunAt::After(Duration::from_secs(3600))))
        .await
        .unwrap()
        .id;
    let claimed = claim(b, 10).await.jobs;
    let order: Vec<JobId> = claimed.iter().map(|j| j.id).collect();
    assert_eq!(order, vec![earliest, late_high, late_mid, late_low]);
    assert_eq!(record(b, future).await.status, JobStatus::Pending);
    let done: Vec<_> = claimed
        .iter()
        .map(|j| (j.claim(), Finalize::Complete))
        .collect();
    b.finalize_many(&done).await.unwrap();
    h.advance_clock(Duration::from_secs(3601)).await;
    assert_eq!(claim(b, 1).await.jobs[0].id, future);
}

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

/// (11) Graceful shutdown releases claimed-but-unstarted jobs at once (fenced), lets the running
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

/// (12) A poison job whose worker dies every time: past the reclaim cap the claim flags it, and
/// burying it (fenced, like any finalize) ends it `dead` for good.
pub async fn reclaim_cap_flags_a_poison_job_and_burying_ends_it_dead<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let capped = req(5).max_reclaims(2);
    for round in 0..3 {
        let job = b.claim(capped).await.unwrap().jobs.remove(0);
        assert_eq!(
            (job.id, job.reclaims, job.taken_over),
            (id, round, round > 0)
        );
        assert!(!job.over_reclaim_cap, "round {round} is within the cap");
        h.advance_clock(lease().duration() + Duration::from_secs(1))
            .await;
    }
    let job = b.claim(capped).await.unwrap().jobs.remove(0);
    assert!(
        job.taken_over && job.over_reclaim_cap,
        "past the cap the claim must flag the job"
    );
    let bury = Finalize::Bury {
        reason: crate::RECLAIM_CAP_MESSAGE.to_owned(),
    };
    assert!(b.finalize(job.claim(), &bury).await.unwrap().is_applied());
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::Dead);
    assert!(
        rec.last_error.as_deref().unwrap_or("").contains("reclaim"),
        "{:?}",
        rec.last_error
    );
    assert!(rec.finished_at.is_some());
    h.advance_clock(lease().duration() * 2).await;
    assert!(
        b.claim(capped).await.unwrap().jobs.is_empty(),
        "a dead job came back"
    );
}

/// The worker buries a job it claims past the reclaim cap, without running it, and the hooks
/// see the burial (so domain state and outbox follow the job to its end).
pub async fn worker_buries_a_poison_job_with_its_hooks<H: Harness>(h: Arc<H>) {
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
    assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "bury")]);
    assert_eq!(record(b, id).await.status, JobStatus::Dead);
}

/// Release: back to pending at its original place in line, the attempt uncounted.
pub async fn release_keeps_place_and_uncounts_the_attempt<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let first = enqueue(b, 1).await;
    let second = enqueue(b, 2).await;
    let job = claim(b, 1).await.jobs.remove(0);
    assert_eq!(job.id, first);
    assert!(
        b.finalize(job.claim(), &Finalize::Release)
            .await
            .unwrap()
            .is_applied()
    );
    let rec = record(b, first).await;
    assert_eq!((rec.status, rec.attempts), (JobStatus::Pending, 0));
    let again = claim(b, 1).await.jobs.remove(0);
    assert_eq!(again.id, first, "a released job keeps its place");
    assert_eq!(again.attempts, 1);
    assert_eq!(again.generation, ClaimGeneration(2));
    assert_eq!(
        b.finalize(job.claim(), &Finalize::Release).await.unwrap(),
        FinalizeOutcome::Stale
    );
    let _ = second;
}

/// Retry: pending again, due later, the error kept; the next run sees one handler error.
pub async fn retry_at_schedules_and_counts_a_handler_error<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let job = claim(b, 1).await.jobs.remove(0);
    let retry = Finalize::RetryAt {
        at: RunAt::After(Duration::from_secs(60)),
        error: "503".into(),
    };
    assert!(b.finalize(job.claim(), &retry).await.unwrap().is_applied());
    let rec = record(b, id).await;
    assert_eq!(rec.status, JobStatus::Pending);
    assert_eq!(rec.last_error.as_deref(), Some("503"));
    assert!(
        claim(b, 1).await.jobs.is_empty(),
        "a retry ran before its time"
    );
    h.advance_clock(Duration::from_secs(61)).await;
    let again = claim(b, 1).await.jobs.remove(0);
    assert_eq!(
        (again.id, again.attempts, again.handler_errors()),
        (id, 2, 1)
    );
}

/// Administrative cancel ends pending jobs only; a lease holder cancels with a fenced write.
pub async fn cancel_only_touches_pending_jobs<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let pending = enqueue(b, 1).await;
    assert_eq!(b.cancel(pending).await.unwrap(), CancelOutcome::Cancelled);
    assert_eq!(
        b.cancel(pending).await.unwrap(),
        CancelOutcome::AlreadyTerminal(JobStatus::Cancelled)
    );
    let running = enqueue(b, 2).await;
    let job = claim(b, 5).await.jobs.remove(0);
    assert_eq!(job.id, running, "a cancelled job was claimed");
    assert_eq!(b.cancel(running).await.unwrap(), CancelOutcome::InFlight);
    assert_eq!(
        b.cancel(JobId(i64::MAX)).await.unwrap(),
        CancelOutcome::NotFound
    );
    let by_holder = Finalize::Cancel {
        reason: "order withdrawn".into(),
    };
    assert!(
        b.finalize(job.claim(), &by_holder)
            .await
            .unwrap()
            .is_applied()
    );
    let rec = record(b, running).await;
    assert_eq!(rec.status, JobStatus::Cancelled);
    assert_eq!(rec.last_error.as_deref(), Some("order withdrawn"));
}

/// A unique key enqueues once and returns the first job's id after.
pub async fn unique_key_enqueues_once<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let job = || NewJob::from_value(json!({})).unique_key("transmission-7");
    let first = b.enqueue(job()).await.unwrap();
    let again = b.enqueue(job()).await.unwrap();
    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(again.id, first.id);
    let many = b
        .enqueue_many(vec![
            job(),
            NewJob::from_value(json!({})).unique_key("other"),
        ])
        .await
        .unwrap();
    assert!(many[0].duplicate && many[0].id == first.id);
    assert!(!many[1].duplicate);
    assert_eq!(b.counts().await.unwrap().pending, 2);
}

/// `enqueue_in` commits and rolls back with the caller's transaction.
pub async fn enqueue_in_is_atomic_with_the_transaction<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let mut tx = b.begin().await.unwrap();
    b.enqueue_in(&mut tx, NewJob::from_value(json!({ "kept": false })))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        b.counts().await.unwrap().total(),
        0,
        "a rolled-back enqueue is visible"
    );
    let mut tx = b.begin().await.unwrap();
    let id = b
        .enqueue_in(&mut tx, NewJob::from_value(json!({ "kept": true })))
        .await
        .unwrap()
        .id;
    tx.commit().await.unwrap();
    let job = claim(b, 1).await.jobs.remove(0);
    assert_eq!((job.id, job.payload), (id, json!({ "kept": true })));
}

/// `enqueue_many` returns ids in input order and stores each payload.
pub async fn enqueue_many_keeps_input_order<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let jobs: Vec<NewJob> = (0..50)
        .map(|n| NewJob::from_value(json!({ "n": n })))
        .collect();
    let ids = b.enqueue_many(jobs).await.unwrap();
    assert_eq!(ids.len(), 50);
    for (n, enqueued) in ids.iter().enumerate() {
        assert_eq!(record(b, enqueued.id).await.payload, json!({ "n": n }));
    }
    assert!(b.enqueue_many(Vec::new()).await.unwrap().is_empty());
}

/// The batched finalize fences every item on its own.
pub async fn finalize_many_fences_each_item<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let a = enqueue(b, 1).await;
    let taken_over = enqueue(b, 2).await;
    let c = enqueue(b, 3).await;
    let jobs = claim(b, 3).await.jobs;
    let old = jobs.iter().find(|j| j.id == taken_over).unwrap().claim();
    // Only `taken_over` is reclaimed: finish the others first.
    h.advance_clock(lease().duration() + Duration::from_secs(1))
        .await;
    let mut by_id: HashMap<JobId, crate::ClaimedJob> =
        jobs.into_iter().map(|j| (j.id, j)).collect();
    let retaken = claim(b, 3).await.jobs;
    assert_eq!(retaken.len(), 3);
    for j in &retaken {
        by_id.insert(j.id, j.clone());
    }
    let outcomes = b
        .finalize_many(&[
            (by_id[&a].claim(), Finalize::Complete),
            (old, Finalize::Complete),
            (
                by_id[&c].claim(),
                Finalize::FailTerminal {
                    error: "bad".into(),
                },
            ),
        ])
        .await
        .unwrap();
    assert_eq!(
        outcomes,
        vec![
            FinalizeOutcome::Applied,
            FinalizeOutcome::Stale,
            FinalizeOutcome::Applied
        ]
    );
    assert_eq!(record(b, a).await.status, JobStatus::Completed);
    assert_eq!(record(b, taken_over).await.status, JobStatus::InFlight);
    let failed = record(b, c).await;
    assert_eq!(
        (failed.status, failed.last_error.as_deref()),
        (JobStatus::Failed, Some("bad"))
    );
    assert!(b.finalize_many(&[]).await.unwrap().is_empty());
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

struct AlwaysFails;

impl Handler for AlwaysFails {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        Err(JobError::retry("partner keeps failing"))
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

struct Noop;

impl Handler for Noop {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        Ok(())
    }
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

/// `get` and `counts` see this queue only.
pub async fn counts_and_get_report_this_queue_only<H: Harness>(h: Arc<H>) {
    let b = h.backend();
    let id = enqueue(b, 1).await;
    let job = claim(b, 1).await.jobs.remove(0);
    enqueue(b, 2).await;
    assert!(
        b.finalize(job.claim(), &Finalize::Complete)
            .await
            .unwrap()
            .is_applied()
    );
    let counts = b.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.completed, counts.total()),
        (1, 1, 2)
    );
    let rec = record(b, id).await;
    assert_eq!(rec.queue, b.queue().as_str());
    assert_eq!(rec.attempts, 1);
    assert!(b.get(JobId(i64::MAX)).await.unwrap().is_none());
}
