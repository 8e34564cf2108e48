//! Claims and leases: who may take a job, when, in what order, and what a takeover does.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DurationRound, TimeDelta, Utc};
use serde_json::json;

use super::{Harness, claim, enqueue, lease, record, req};
use crate::backend::Backend;
use crate::types::{
    ClaimGeneration, ClaimRequest, Finalize, Heartbeat, JobId, JobStatus, Lease, NewJob, RunAt,
};

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

cases! {
    $ __conformance_lease;

    /// A job claimed out of an overdue backlog keeps its lease: the claim clock is `claimed_at`,
    /// not `next_attempt_at` (the incident's wrong-clock sweep, ADR 0001).
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

    /// An expired lease is taken over: generation + 1, attempts + 1, `claimed_at` refreshed.
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

    /// Several tasks race claims over M jobs: each job is taken exactly once, none is lost.
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

    /// The same race over expired leases: each is taken over exactly once, at generation 2.
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

    /// A legacy row (in flight, no `claimed_at`) counts as expired: re-claimable at once.
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

    /// The heartbeat is fenced like a finalizer, and it restarts the lease.
    pub async fn extend_lease_is_fenced_and_postpones_expiry<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let job = claim(b, 1).await.jobs.remove(0);
        h.advance_clock(Duration::from_secs(60)).await;
        assert_eq!(
            b.extend_lease(job.claim(), lease()).await.unwrap(),
            Heartbeat::Held
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
            b.extend_lease(job.claim(), lease()).await.unwrap(),
            Heartbeat::Lost
        );
        assert_eq!(
            b.extend_lease(taken.claim(), lease()).await.unwrap(),
            Heartbeat::Held
        );
    }

    /// Heartbeats of many claims at once: each answered for its own claim, in order, fenced as
    /// one heartbeat is (a claim of another generation is lost, a job an operator asked to
    /// cancel says so, a claim asked twice gets one answer twice), and each lease restarted.
    pub async fn extend_leases_answers_each_claim_fenced<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        for n in 0..4 {
            enqueue(b, n).await;
        }
        let jobs = claim(b, 4).await.jobs;
        assert_eq!(jobs.len(), 4);
        b.cancel(jobs[2].id).await.unwrap();
        let mut stale = jobs[1].claim();
        stale.generation.0 += 1;
        let claims = [jobs[0].claim(), stale, jobs[2].claim(), jobs[0].claim(), jobs[3].claim()];
        assert!(b.extend_leases(&[], lease()).await.unwrap().is_empty());
        h.advance_clock(Duration::from_secs(60)).await;
        let answers = b.extend_leases(&claims, lease()).await.unwrap();
        // A store may leave a claim unanswered only when another transaction holds its row:
        // none does here.
        let answers: Vec<Heartbeat> = answers.into_iter().map(Option::unwrap).collect();
        assert_eq!(
            answers,
            [
                Heartbeat::Held,
                Heartbeat::Lost,
                Heartbeat::CancelRequested,
                Heartbeat::Held,
                Heartbeat::Held
            ]
        );
        h.advance_clock(Duration::from_secs(60)).await;
        // 120 s since the claim, 60 s since the heartbeats: only the job whose lease was not
        // renewed (its claim's generation did not match) is taken over.
        let taken = claim(b, 4).await.jobs;
        let ids: Vec<JobId> = taken.iter().map(|j| j.id).collect();
        assert_eq!(ids, [jobs[1].id], "the renewed leases still run");
    }

    /// Claim order: `next_attempt_at`, then priority (lower first); future jobs wait.
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

    /// A poison job whose worker dies every time: past the reclaim cap the claim flags it, and
    /// ending it with `Finalize::Dead` (fenced, like any finalize) is for good.
    pub async fn reclaim_cap_flags_a_poison_job_that_then_ends_dead<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let capped = req(5).max_reclaims(2);
        for round in 0..3 {
            let job = b.claim(capped.clone()).await.unwrap().jobs.remove(0);
            assert_eq!(
                (job.id, job.reclaims, job.taken_over),
                (id, round, round > 0)
            );
            assert!(!job.over_reclaim_cap, "round {round} is within the cap");
            h.advance_clock(lease().duration() + Duration::from_secs(1))
                .await;
        }
        let job = b.claim(capped.clone()).await.unwrap().jobs.remove(0);
        assert!(
            job.taken_over && job.over_reclaim_cap,
            "past the cap the claim must flag the job"
        );
        let dead = Finalize::Dead {
            reason: crate::RECLAIM_CAP_MESSAGE.to_owned(),
        };
        assert!(b.finalize(job.claim(), &dead).await.unwrap().is_applied());
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
            b.claim(capped.clone()).await.unwrap().jobs.is_empty(),
            "a dead job came back"
        );
    }

    /// The lease is stored with the claim, by the store's clock: a claimer with a shorter lease
    /// cannot take over a job held under a longer one, and workers with different leases share
    /// a queue safely.
    pub async fn the_holders_lease_decides_not_the_claimers<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let long = ClaimRequest::new(1, Lease::from_secs(600).unwrap());
        let short = ClaimRequest::new(1, Lease::from_secs(1).unwrap());
        let held = b.claim(long.clone()).await.unwrap().jobs.remove(0);
        h.advance_clock(Duration::from_secs(5)).await;
        assert!(
            b.claim(short.clone()).await.unwrap().jobs.is_empty(),
            "a claimer with a 1 s lease took a job held under 600 s"
        );
        h.advance_clock(Duration::from_secs(596)).await;
        let taken = b.claim(short.clone()).await.unwrap().jobs.remove(0);
        assert_eq!((taken.id, taken.generation.0), (id, held.generation.0 + 1));
        // Held under 1 s now: a claimer with a long lease takes it over once that second passed.
        h.advance_clock(Duration::from_secs(2)).await;
        let again = b.claim(long.clone()).await.unwrap().jobs.remove(0);
        assert_eq!((again.id, again.generation.0), (id, taken.generation.0 + 1));
    }
}
