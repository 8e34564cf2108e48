//! The admin API: listing, retrying, purging, pausing, draining, the error history.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use super::{Harness, claim, enqueue, lease, record};
use crate::admin::{Admin, JobFilter, PurgeRequest, RetryTarget, drain, purge, retry_with_hooks};
use crate::backend::Backend;
use crate::error::{BoxError, Error, InvalidInput};
use crate::handler::{Handler, JobContext, JobError};
use crate::hooks::{FinalizeEvent, FinalizeHook, Hooks, ReopenEvent};
use crate::limits::ERROR_HISTORY_LEN;
use crate::types::{ClaimRequest, Finalize, FinalizeOutcome, JobId, JobStatus, NewJob, RunAt};
use crate::worker::{Worker, WorkerConfig};

/// Ends the job `id` (claimed at once) with `action`.
async fn end<B: Backend>(b: &B, id: JobId, action: Finalize) {
    let job = claim(b, 1).await.jobs.remove(0);
    assert_eq!(job.id, id, "the job to end must be the next one claimed");
    assert_eq!(
        b.finalize(job.claim(), &action).await.unwrap(),
        FinalizeOutcome::Applied
    );
}

fn dead() -> Finalize {
    Finalize::Dead {
        reason: "poison".into(),
    }
}

/// Records what it is told of reopened jobs; refuses when asked to.
#[derive(Clone, Default)]
struct Reopened {
    seen: Arc<Mutex<Vec<(JobId, JobStatus, JobStatus)>>>,
    refuse: bool,
}

impl<Tx: Send, P: Sync> FinalizeHook<Tx, P> for Reopened {
    fn name(&self) -> &str {
        "reopened"
    }
    async fn after_applied(&self, _: &mut Tx, _: &FinalizeEvent<'_, P>) -> Result<(), BoxError> {
        Ok(())
    }
    async fn after_reopened(
        &self,
        _tx: &mut Tx,
        event: &ReopenEvent<'_, P>,
    ) -> Result<(), BoxError> {
        if self.refuse {
            return Err("the domain row is not failed".into());
        }
        self.seen
            .lock()
            .unwrap()
            .push((event.job.id, event.previous, event.job.status));
        Ok(())
    }
}

/// Holds its job until told to finish.
struct Held {
    started: Arc<tokio::sync::Notify>,
    open: Arc<tokio::sync::Notify>,
}

impl Handler for Held {
    type Payload = Value;
    async fn handle(&self, _ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        self.started.notify_one();
        self.open.notified().await;
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
    $ __conformance_admin;

    /// Listing is newest first, filtered by status, and keyset-paginated: every job once,
    /// pages never overlap, the last page says it is the last.
    pub async fn list_jobs_pages_newest_first_by_status<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let ids: Vec<JobId> = {
            let mut ids = Vec::new();
            for n in 0..7 {
                ids.push(enqueue(b, n).await);
            }
            ids
        };
        end(b, ids[0], dead()).await;
        end(b, ids[1], Finalize::Fail { error: "bad".into() }).await;
        end(b, ids[2], dead()).await;

        let mut seen = Vec::new();
        let mut filter = JobFilter::new().limit(3);
        let mut pages = 0;
        loop {
            let page = b.list_jobs(&filter).await.unwrap();
            pages += 1;
            assert!(page.jobs.len() <= 3);
            seen.extend(page.jobs.iter().map(|j| j.id));
            match page.next {
                Some(cursor) => filter = filter.before(cursor),
                None => break,
            }
        }
        let newest_first: Vec<JobId> = ids.iter().rev().copied().collect();
        assert_eq!(seen, newest_first, "every job once, newest first");
        assert_eq!(pages, 3);

        let dead_jobs = b
            .list_jobs(&JobFilter::new().status(JobStatus::Dead))
            .await
            .unwrap();
        assert_eq!(
            dead_jobs.jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
            [ids[2], ids[0]]
        );
        assert_eq!(dead_jobs.next, None);
        let ended = b
            .list_jobs(
                &JobFilter::new()
                    .status(JobStatus::Dead)
                    .status(JobStatus::Failed)
                    .limit(2),
            )
            .await
            .unwrap();
        assert_eq!(
            ended.jobs.iter().map(|j| j.id).collect::<Vec<_>>(),
            [ids[2], ids[1]]
        );
        let rest = b
            .list_jobs(
                &JobFilter::new()
                    .status(JobStatus::Dead)
                    .status(JobStatus::Failed)
                    .before(ended.next.expect("a next page")),
            )
            .await
            .unwrap();
        assert_eq!(rest.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [ids[0]]);
        let pending = b
            .list_jobs(&JobFilter::new().status(JobStatus::Pending))
            .await
            .unwrap();
        assert_eq!(pending.jobs.len(), 4);
        assert!(pending.jobs.iter().all(|j| j.status == JobStatus::Pending));
    }

    /// A retry reopens only a job in the state the operator saw: back to pending, due now,
    /// attempts and reclaims reset, the generation still counting up.
    pub async fn retry_reopens_only_what_the_operator_saw<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = b
            .enqueue(NewJob::from_value(json!({ "n": 1 })).run_at(RunAt::Now))
            .await
            .unwrap()
            .id;
        end(b, id, dead()).await;
        let before = record(b, id).await;
        let hooks: Hooks<<H::Backend as Backend>::Tx, Value> = Hooks::new();

        let wrong = retry_with_hooks(b, &hooks, id, JobStatus::Failed).await.unwrap();
        assert_eq!(wrong, RetryTarget::WrongState(JobStatus::Dead));
        assert_eq!(record(b, id).await, before, "a wrong guess changes nothing");
        let refused = retry_with_hooks(b, &hooks, id, JobStatus::Completed).await;
        assert!(matches!(
            refused,
            Err(Error::Invalid(InvalidInput::NotRetryable { status: JobStatus::Completed }))
        ));
        assert_eq!(
            retry_with_hooks(b, &hooks, JobId(id.0 + 1_000), JobStatus::Dead).await.unwrap(),
            RetryTarget::NotFound
        );

        let RetryTarget::Retried(job) =
            retry_with_hooks(b, &hooks, id, JobStatus::Dead).await.unwrap()
        else {
            panic!("a dead job is retried");
        };
        assert_eq!(job.status, JobStatus::Pending);
        assert_eq!((job.attempts, job.reclaims), (0, 0));
        assert_eq!(job.finished_at, None);
        assert_eq!(job.lease_expires_at, None);
        assert_eq!(job.claim_generation, before.claim_generation);
        assert_eq!(job.errors, before.errors, "the history stays");
        assert_eq!(record(b, id).await, *job);
        // Due at once, and its next claim carries a generation never issued before.
        let again = claim(b, 1).await.jobs.remove(0);
        assert_eq!(again.id, id);
        assert_eq!(again.generation.0, before.claim_generation.0 + 1);
        assert_eq!(again.attempts, 1);
        // A job in flight is not the operator's to reopen.
        assert_eq!(
            retry_with_hooks(b, &hooks, id, JobStatus::Dead).await.unwrap(),
            RetryTarget::WrongState(JobStatus::InFlight)
        );
    }

    /// The hooks see a reopened job in the same transaction; a hook's refusal leaves the job
    /// as it was.
    pub async fn retry_runs_the_hooks_and_a_refusal_changes_nothing<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        end(b, id, Finalize::Cancel { reason: "by hand".into() }).await;
        let before = record(b, id).await;

        let refusing = Reopened { refuse: true, ..Reopened::default() };
        let hooks: Hooks<<H::Backend as Backend>::Tx, Value> = Hooks::new().with(refusing);
        let err = retry_with_hooks(b, &hooks, id, JobStatus::Cancelled).await.unwrap_err();
        assert!(matches!(err, Error::Hook { ref hook, .. } if hook == "reopened"), "{err}");
        assert_eq!(record(b, id).await, before, "a refused retry changes nothing");

        let recorder = Reopened::default();
        let hooks: Hooks<<H::Backend as Backend>::Tx, Value> = Hooks::new().with(recorder.clone());
        let target = retry_with_hooks(b, &hooks, id, JobStatus::Cancelled).await.unwrap();
        assert!(matches!(target, RetryTarget::Retried(_)));
        assert_eq!(
            *recorder.seen.lock().unwrap(),
            [(id, JobStatus::Cancelled, JobStatus::Pending)]
        );
    }

    /// Each error a holder reports joins the job's history with its attempt, generation, time,
    /// outcome and holder; the history keeps the last ten.
    pub async fn the_error_history_keeps_the_last_errors_with_their_holder<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let rounds = ERROR_HISTORY_LEN + 2;
        for round in 1..=rounds {
            let job = b
                .claim(ClaimRequest::new(1, lease()).holder(format!("worker-{round}")))
                .await
                .unwrap()
                .jobs
                .remove(0);
            let action = if round == rounds {
                Finalize::Fail { error: format!("error {round}") }
            } else {
                Finalize::Retry { at: RunAt::Now, error: format!("error {round}") }
            };
            assert_eq!(b.finalize(job.claim(), &action).await.unwrap(), FinalizeOutcome::Applied);
        }
        let job = record(b, id).await;
        assert_eq!(job.errors.len(), ERROR_HISTORY_LEN);
        let first = &job.errors[0];
        assert_eq!((first.attempt, first.generation), (3, 3));
        assert_eq!(first.error, "error 3");
        let last = job.errors.last().unwrap();
        assert_eq!((last.attempt, last.generation), (rounds as i32, rounds as i64));
        assert_eq!(last.outcome, "fail");
        assert_eq!(last.worker.as_deref(), Some(format!("worker-{rounds}").as_str()));
        assert_eq!(job.errors[5].outcome, "retry");
        assert_eq!(job.claimed_by.as_deref(), Some(format!("worker-{rounds}").as_str()));
        assert!(job.errors.windows(2).all(|w| w[0].at <= w[1].at));
        // A completion adds nothing; a huge error is kept short in the history.
        let other = enqueue(b, 2).await;
        let job = claim(b, 1).await.jobs.remove(0);
        let long = Finalize::Fail { error: "x".repeat(5_000) };
        assert_eq!(b.finalize(job.claim(), &long).await.unwrap(), FinalizeOutcome::Applied);
        let kept = &record(b, other).await.errors[0].error;
        assert_eq!(kept.chars().count(), crate::limits::HISTORY_ERROR_CHARS);
        assert_eq!(kept.as_str(), &"x".repeat(crate::limits::HISTORY_ERROR_CHARS));
    }

    /// A unique key finds its job; another key finds nothing.
    pub async fn a_unique_key_finds_its_job<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = b
            .enqueue(NewJob::from_value(json!({})).unique_key("invoice-7"))
            .await
            .unwrap()
            .id;
        assert_eq!(b.find_by_unique_key("invoice-7").await.unwrap().map(|j| j.id), Some(id));
        assert_eq!(b.find_by_unique_key("invoice-8").await.unwrap(), None);
    }

    /// Purge deletes only terminal jobs of the statuses asked, finished before the age, in
    /// bounded batches; live jobs and recent ones stay.
    pub async fn purge_deletes_old_terminal_jobs_of_the_statuses_in_batches<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let mut old_completed = Vec::new();
        for n in 0..5 {
            let id = enqueue(b, n).await;
            end(b, id, Finalize::Complete).await;
            old_completed.push(id);
        }
        let old_dead = enqueue(b, 10).await;
        end(b, old_dead, dead()).await;
        let pending = b
            .enqueue(NewJob::from_value(json!({})).run_at(RunAt::After(Duration::from_secs(86_400))))
            .await
            .unwrap()
            .id;
        h.advance_clock(Duration::from_secs(7_200)).await;
        let recent = enqueue(b, 20).await;
        end(b, recent, Finalize::Complete).await;

        let request = PurgeRequest::new(&[JobStatus::Completed], Duration::from_secs(3_600))
            .unwrap()
            .batch_size(2);
        let mut totals = Vec::new();
        let deleted = purge(b, &request, |total| totals.push(total), || true).await.unwrap();
        assert_eq!(deleted, 5);
        assert_eq!(totals, [2, 4, 5], "one bounded batch per statement");
        for id in old_completed {
            assert!(b.get(id).await.unwrap().is_none(), "old completed job {id} survived");
        }
        for id in [old_dead, pending, recent] {
            assert!(b.get(id).await.unwrap().is_some(), "job {id} was purged");
        }
        // Stopped between batches, a purge keeps what it has not reached.
        let request = PurgeRequest::new(&[JobStatus::Dead], Duration::ZERO).unwrap().batch_size(1);
        assert_eq!(purge(b, &request, |_| {}, || false).await.unwrap(), 1);
    }

    /// A paused queue gives no claim, not even of an expired lease, to any handle; pausing
    /// again keeps the first pause; a resume gives work again.
    pub async fn a_paused_queue_gives_no_claim_until_resumed<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let taken = enqueue(b, 1).await;
        let waiting = enqueue(b, 2).await;
        assert_eq!(claim(b, 1).await.jobs[0].id, taken);
        assert!(!b.control().await.unwrap().is_paused());
        let paused = b.pause().await.unwrap();
        assert!(paused.is_paused());
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let other = b.clone();
        assert!(other.claim(ClaimRequest::new(10, lease())).await.unwrap().jobs.is_empty());
        assert_eq!(other.control().await.unwrap(), paused);
        assert_eq!(b.pause().await.unwrap(), paused, "a second pause keeps the first");
        assert_eq!(record(b, waiting).await.status, JobStatus::Pending);

        assert!(!b.resume().await.unwrap().is_paused());
        let ids: HashSet<JobId> = claim(b, 10).await.jobs.iter().map(|j| j.id).collect();
        assert_eq!(ids, HashSet::from([taken, waiting]));
    }

    /// A worker stops claiming from a queue paused under it, and picks up again on resume.
    pub async fn a_worker_claims_nothing_from_a_paused_queue<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let config = WorkerConfig {
            poll_interval: Duration::from_millis(20),
            ..WorkerConfig::default()
        };
        let worker = Worker::new(b.clone(), Noop, config).unwrap().start();
        enqueue(b, 1).await;
        worker.wait_for_timeout(Duration::from_secs(30), |s| s.completed == 1).await.unwrap();
        b.pause().await.unwrap();
        let id = enqueue(b, 2).await;
        // Two claim passes after the pause: both found nothing to take.
        let passes = worker.stats().claim_passes;
        worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.claim_passes >= passes + 2)
            .await
            .unwrap();
        assert_eq!(record(b, id).await.status, JobStatus::Pending);
        b.resume().await.unwrap();
        worker.wait_for_timeout(Duration::from_secs(30), |s| s.completed == 2).await.unwrap();
        worker.shutdown().await.unwrap();
    }

    /// Drain pauses the queue and reports running jobs until they finish; a job whose lease
    /// passed is stranded, not running.
    pub async fn drain_waits_for_running_jobs_and_counts_stranded_ones<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue(b, 1).await;
        let running = claim(b, 1).await.jobs.remove(0);
        let report = drain(b, Duration::ZERO, Duration::from_millis(10)).await.unwrap();
        assert!(b.control().await.unwrap().is_paused());
        assert_eq!((report.running, report.drained), (1, false));
        let done = b.finalize(running.claim(), &Finalize::Complete).await.unwrap();
        assert_eq!(done, FinalizeOutcome::Applied);
        let report = drain(b, Duration::from_secs(5), Duration::from_millis(10)).await.unwrap();
        assert_eq!((report.running, report.stranded, report.drained), (0, 0, true));

        b.resume().await.unwrap();
        enqueue(b, 2).await;
        claim(b, 1).await.jobs.remove(0);
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let report = drain(b, Duration::ZERO, Duration::from_millis(10)).await.unwrap();
        assert_eq!((report.running, report.stranded, report.drained), (0, 1, true));
    }

    /// Throughput: the jobs that ended in each of the last minutes, by status, zeros included;
    /// another queue's jobs are not counted.
    pub async fn throughput_counts_what_ended_per_minute<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        for n in 0..3 {
            let id = enqueue(b, n).await;
            end(b, id, Finalize::Complete).await;
        }
        let id = enqueue(b, 9).await;
        end(b, id, dead()).await;
        let other = h.other_queue(crate::types::QueueName::new("conformance-other").unwrap());
        other.enqueue(NewJob::from_value(json!({}))).await.unwrap();
        let job = claim(&other, 1).await.jobs.remove(0);
        let done = other.finalize(job.claim(), &Finalize::Complete).await.unwrap();
        assert_eq!(done, FinalizeOutcome::Applied);

        let minutes = b.throughput(5).await.unwrap();
        assert_eq!(minutes.len(), 5);
        assert!(minutes.windows(2).all(|w| w[1].minute - w[0].minute == chrono::TimeDelta::minutes(1)));
        let total = minutes.iter().fold((0, 0, 0), |(c, d, f), m| {
            (c + m.finished.completed, d + m.finished.dead, f + m.finished.failed)
        });
        assert_eq!(total, (3, 1, 0), "{minutes:?}");
        assert!(minutes[..3].iter().all(|m| m.finished == Default::default()));
    }

    /// A fenced outcome of a worker is counted for operators (`QueueControl::stale_fences`).
    pub async fn a_workers_stale_fence_is_counted_for_operators<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        assert_eq!(b.control().await.unwrap().stale_fences, 0);
        b.record_stale(2).await.unwrap();
        let control = b.control().await.unwrap();
        assert_eq!(control.stale_fences, 2);
        assert!(control.last_stale_at.is_some());
        assert!(!control.is_paused(), "a count pauses nothing");
        assert!(
            b.queues().await.unwrap().contains(b.queue()),
            "a queue whose workers met a stale fence is listed"
        );

        // A worker whose write the fence refuses counts it.
        let id = enqueue(b, 1).await;
        let gate = Arc::new(tokio::sync::Notify::new());
        let (started, open) = (Arc::new(tokio::sync::Notify::new()), gate.clone());
        let worker = Worker::new(
            b.clone(),
            Held { started: started.clone(), open },
            // One slot: while the job runs the worker claims nothing, so only the test takes it
            // over (a wake-up must not let the worker take its own job over).
            WorkerConfig {
                concurrency: 1,
                poll_interval: Duration::from_secs(3600),
                ..WorkerConfig::default()
            },
        )
        .unwrap()
        .start();
        started.notified().await;
        h.advance_clock(WorkerConfig::default().lease.duration() + Duration::from_secs(1)).await;
        assert_eq!(claim(b, 1).await.jobs[0].id, id, "taken over");
        gate.notify_one();
        worker.wait_for_timeout(Duration::from_secs(30), |s| s.stale == 1).await.unwrap();
        worker.shutdown().await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while b.control().await.unwrap().stale_fences < 3 {
            assert!(tokio::time::Instant::now() < deadline, "the worker's stale fence was not counted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The store lists the queues that have work or a pause, not one that was paused and
    /// resumed with nothing in it.
    pub async fn queues_lists_those_with_work_or_a_pause<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue(b, 1).await;
        let queues = b.queues().await.unwrap();
        assert_eq!(queues, [b.queue().clone()]);
        // A handle on another queue of the same store: paused, it is listed; resumed, not.
        let other = h.other_queue(crate::types::QueueName::new("conformance-other").unwrap());
        other.pause().await.unwrap();
        let queues = b.queues().await.unwrap();
        assert!(queues.contains(other.queue()), "{queues:?}");
        other.resume().await.unwrap();
        assert_eq!(b.queues().await.unwrap(), [b.queue().clone()]);
        // A queue a worker serves is listed though it holds nothing.
        let served = h.other_queue(crate::types::QueueName::new("conformance-served").unwrap());
        served.note_served().await.unwrap();
        assert!(b.queues().await.unwrap().contains(served.queue()));
    }
}
