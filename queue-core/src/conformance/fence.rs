//! The generation fence: every lease-holder write applies only under its own claim.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{Harness, claim, claim_then_take_over, enqueue, lease, record, req};
use crate::backend::{Backend, BackendTx};
use chrono::{TimeDelta, Utc};
use serde_json::json;

use crate::error::{Error, InvalidInput};
use crate::limits;
use crate::types::{
    CancelOutcome, Claim, ClaimGeneration, ClaimToken, ClaimedJob, Finalize, FinalizeOutcome,
    Heartbeat, JobId, JobStatus, NewJob, RunAt,
};

cases! {
    $ __conformance_fence;

    /// The failover case: a store that lost committed writes hands the same generation out a
    /// second time. A holder with the right generation but a token this claim did not draw is
    /// fenced on every write (finalize, batched finalize, heartbeat); the true holder's writes
    /// apply. Every claim stores its token, and a takeover draws a new one.
    pub async fn a_reissued_generation_with_another_token_is_fenced<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let job = claim(b, 1).await.jobs.remove(0);
        assert_ne!(job.token, ClaimToken(0), "a claim draws a token");
        let rec = record(b, id).await;
        assert_eq!(rec.claim_token, job.token);
        assert_eq!(rec.claim_generation, job.generation);

        // What the old primary's holder carries after the new primary reissued its generation.
        let ghost = Claim {
            token: ClaimToken(job.token.0.wrapping_add(1)),
            ..job.claim()
        };
        assert_eq!(ghost.generation, job.generation);
        for action in [
            Finalize::Complete,
            Finalize::Fail { error: "ghost".into() },
            Finalize::Retry { at: RunAt::Now, error: "ghost".into() },
            Finalize::Release,
        ] {
            assert_eq!(
                b.finalize(ghost, &action).await.unwrap(),
                FinalizeOutcome::Stale,
                "{action:?} under a token the claim did not draw"
            );
        }
        assert_eq!(
            b.extend_lease(ghost, lease()).await.unwrap(),
            Heartbeat::Lost
        );
        let rec = record(b, id).await;
        assert_eq!(rec.status, JobStatus::InFlight);
        assert_eq!(rec.attempts, 1, "the ghost's release gave no attempt back");
        assert_eq!(rec.last_error, None);

        // The ghost and the true holder of one job in one batch: only the true holder's write
        // applies, and each gets its own answer.
        let both = b
            .finalize_many(&[
                (ghost, Finalize::Retry { at: RunAt::Now, error: "ghost".into() }),
                (job.claim(), Finalize::Release),
            ])
            .await
            .unwrap();
        assert_eq!(both, [FinalizeOutcome::Stale, FinalizeOutcome::Applied]);
        let job = claim(b, 1).await.jobs.remove(0);
        assert_eq!(job.id, id, "the released job is claimed again");

        // In one batch with the true holder: only the true holder's write applies.
        let other = enqueue(b, 2).await;
        let other_job = claim(b, 1).await.jobs.remove(0);
        assert_eq!(other_job.id, other);
        let ghost_of_other = Claim {
            token: ClaimToken(other_job.token.0 ^ 0x5a5a),
            ..other_job.claim()
        };
        assert_eq!(
            b.finalize_many(&[
                (ghost_of_other, Finalize::Complete),
                (job.claim(), Finalize::Complete),
            ])
            .await
            .unwrap(),
            [FinalizeOutcome::Stale, FinalizeOutcome::Applied]
        );
        assert_eq!(record(b, id).await.status, JobStatus::Completed);
        assert_eq!(record(b, other).await.status, JobStatus::InFlight);

        // A takeover draws a new token, so the old holder is fenced by both halves.
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let again = claim(b, 1).await.jobs.remove(0);
        assert_eq!(again.id, other);
        assert_ne!(again.token, other_job.token);
        assert_eq!(record(b, other).await.claim_token, again.token);
        assert_eq!(
            b.extend_lease(again.claim(), lease()).await.unwrap(),
            Heartbeat::Held
        );
        assert!(
            b.finalize(again.claim(), &Finalize::Complete)
                .await
                .unwrap()
                .is_applied()
        );
    }

    /// The old holder's complete is fenced; the job stays in flight under the new generation,
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

    /// The double-send incident's defect: a stale terminal failure overwriting a completed job.
    pub async fn stale_fail_cannot_overwrite_completed<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let (old, new) = claim_then_take_over(&*h, id).await;
        assert!(
            b.finalize(new.claim(), &Finalize::Complete)
                .await
                .unwrap()
                .is_applied()
        );
        let stale = Finalize::Fail {
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

    /// A status-only guard is not enough: the job is in flight, just not for this holder.
    pub async fn stale_retry_cannot_yank_active_claim<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let (old, new) = claim_then_take_over(&*h, id).await;
        let retry = Finalize::Retry {
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
    pub async fn retry_schedules_and_counts_a_handler_error<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let job = claim(b, 1).await.jobs.remove(0);
        let retry = Finalize::Retry {
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
        let mut by_id: HashMap<JobId, ClaimedJob> =
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
                    Finalize::Fail {
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

    /// The claim that carries outcomes ([`Backend::finalize_and_claim`]): each outcome is
    /// fenced as in `finalize_many` (answers in input order), the claim takes what a claim
    /// would, and a job whose outcome the call writes after its lease ran out is not taken
    /// over by the same call: its holder's outcome stands.
    pub async fn finalize_and_claim_writes_fenced_outcomes_then_claims<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let a = enqueue(b, 1).await;
        let held = enqueue(b, 2).await;
        let c = enqueue(b, 3).await;
        let d = enqueue(b, 4).await;
        let first = claim(b, 2).await.jobs;
        assert_eq!(first.iter().map(|j| j.id).collect::<Vec<_>>(), [a, held]);
        let ghost = Claim {
            token: ClaimToken(first[1].token.0 ^ 0x77),
            ..first[1].claim()
        };
        let (outcomes, batch) = b
            .finalize_and_claim(
                &[
                    (first[0].claim(), Finalize::Complete),
                    (ghost, Finalize::Fail { error: "ghost".into() }),
                ],
                req(10),
            )
            .await
            .unwrap();
        assert_eq!(outcomes, [FinalizeOutcome::Applied, FinalizeOutcome::Stale]);
        assert_eq!(batch.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [c, d]);
        assert_eq!(record(b, a).await.status, JobStatus::Completed);
        let rec = record(b, held).await;
        assert_eq!((rec.status, rec.last_error), (JobStatus::InFlight, None));
        for job in &batch.jobs {
            let rec = record(b, job.id).await;
            assert_eq!((rec.status, rec.attempts), (JobStatus::InFlight, 1));
            assert_eq!((rec.claim_generation, rec.claim_token), (job.generation, job.token));
        }

        // The carried jobs' own outcomes, with nothing left to claim.
        let (outcomes, none) = b
            .finalize_and_claim(
                &[
                    (batch.jobs[0].claim(), Finalize::Complete),
                    (
                        batch.jobs[1].claim(),
                        Finalize::Retry {
                            at: RunAt::After(Duration::from_secs(30)),
                            error: "later".into(),
                        },
                    ),
                ],
                req(10),
            )
            .await
            .unwrap();
        assert_eq!(outcomes, [FinalizeOutcome::Applied, FinalizeOutcome::Applied]);
        assert!(none.jobs.is_empty(), "{:?}", none.jobs);

        // `held` outlived its lease: its holder's outcome applies, and the same call does not
        // take it over.
        h.advance_clock(lease().duration() + Duration::from_secs(1))
            .await;
        let (outcomes, batch) = b
            .finalize_and_claim(&[(first[1].claim(), Finalize::Complete)], req(10))
            .await
            .unwrap();
        assert_eq!(outcomes, [FinalizeOutcome::Applied]);
        assert_eq!(batch.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), [d], "the retry is due");
        assert_eq!(record(b, held).await.status, JobStatus::Completed);

        // Without outcomes it is a claim.
        let (outcomes, batch) = b.finalize_and_claim(&[], req(10)).await.unwrap();
        assert!(outcomes.is_empty() && batch.jobs.is_empty());
    }

    /// A savepoint undoes one job's fenced write and keeps the earlier ones of the same
    /// transaction, which then commit; a backend without savepoints refuses them.
    pub async fn a_savepoint_undoes_only_what_came_after_it<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let kept = enqueue(b, 1).await;
        let undone = enqueue(b, 2).await;
        let jobs = claim(b, 2).await.jobs;
        let mut tx = b.begin().await.unwrap();
        if !b.savepoints() {
            assert!(tx.savepoint().await.is_err());
            return;
        }
        tx.savepoint().await.unwrap();
        let first = b.finalize_in(&mut tx, jobs[0].claim(), &Finalize::Complete).await;
        tx.savepoint().await.unwrap();
        let failed = Finalize::Fail { error: "undone".into() };
        let second = b.finalize_in(&mut tx, jobs[1].claim(), &failed).await;
        assert_eq!((first.unwrap(), second.unwrap()), (FinalizeOutcome::Applied, FinalizeOutcome::Applied));
        tx.rollback_to_savepoint().await.unwrap();
        // The transaction goes on after the rollback: the second job's write again, differently.
        let again = b.finalize_in(&mut tx, jobs[1].claim(), &Finalize::Release).await;
        assert_eq!(again.unwrap(), FinalizeOutcome::Applied);
        tx.commit().await.unwrap();
        assert_eq!(record(b, kept).await.status, JobStatus::Completed);
        let rec = record(b, undone).await;
        assert_eq!((rec.status, rec.attempts, rec.last_error), (JobStatus::Pending, 0, None));
    }

    /// Administrative cancel ends a pending job at once; for a job in flight it asks the holder,
    /// who alone writes the end (fenced).
    pub async fn cancel_ends_pending_jobs_and_asks_the_holder_of_the_rest<H: Harness>(h: Arc<H>) {
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
        assert_eq!(b.cancel(running).await.unwrap(), CancelOutcome::Requested);
        assert_eq!(
            record(b, running).await.status,
            JobStatus::InFlight,
            "a cancel raced the holder"
        );
        assert_eq!(
            b.extend_lease(job.claim(), lease()).await.unwrap(),
            Heartbeat::CancelRequested,
            "the holder learns the request at its heartbeat"
        );
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

    /// One bad value never costs the other outcomes of a batch their write: error text with a
    /// NUL character or past the size cap, and a retry delay past the range, are made storable.
    pub async fn finalize_many_makes_bad_values_storable<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let jobs: Vec<NewJob> = (0..9).map(|n| NewJob::from_value(json!({ "n": n }))).collect();
        b.enqueue_many(jobs).await.unwrap();
        let claimed = claim(b, 9).await.jobs;
        assert_eq!(claimed.len(), 9);
        let long = format!("partner said \0 no {}", "x".repeat(100_000));
        let mut items: Vec<(Claim, Finalize)> = claimed[..7]
            .iter()
            .map(|j| (j.claim(), Finalize::Complete))
            .collect();
        items.push((claimed[7].claim(), Finalize::Fail { error: long }));
        let never = Finalize::Retry {
            at: RunAt::After(Duration::MAX),
            error: "later\0".into(),
        };
        items.push((claimed[8].claim(), never));
        let outcomes = b.finalize_many(&items).await.expect("a storable batch");
        assert!(outcomes.iter().all(|o| o.is_applied()), "{outcomes:?}");
        for job in &claimed[..7] {
            assert_eq!(record(b, job.id).await.status, JobStatus::Completed);
        }
        let failed = record(b, claimed[7].id).await;
        let error = failed.last_error.unwrap_or_default();
        assert_eq!(failed.status, JobStatus::Failed);
        assert!(!error.contains('\0') && error.starts_with("partner said  no"), "{error:.40}");
        assert!(error.len() <= limits::MAX_ERROR_BYTES, "{} bytes kept", error.len());
        let retried = record(b, claimed[8].id).await;
        assert_eq!(retried.status, JobStatus::Pending);
        assert_eq!(retried.last_error.as_deref(), Some("later"));
        let latest = Utc::now() + TimeDelta::from_std(limits::MAX_DELAY).unwrap();
        assert!(retried.next_attempt_at <= latest + TimeDelta::days(1));
        assert!(retried.next_attempt_at >= latest - TimeDelta::days(1));
    }

    /// Two outcomes for one claim in one batch are refused with a typed error, and nothing of the
    /// batch is written.
    pub async fn finalize_many_refuses_two_outcomes_for_one_claim<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        b.enqueue_many(vec![NewJob::from_value(json!({})), NewJob::from_value(json!({}))])
            .await
            .unwrap();
        let jobs = claim(b, 2).await.jobs;
        let (a, other) = (&jobs[0], &jobs[1]);
        let fail = Finalize::Fail {
            error: "no".into(),
        };
        let items = [
            (a.claim(), Finalize::Complete),
            (other.claim(), Finalize::Complete),
            (a.claim(), fail),
        ];
        let err = b.finalize_many(&items).await.unwrap_err();
        assert!(
            matches!(&err, Error::Invalid(InvalidInput::DuplicateClaim { id, .. }) if *id == a.id),
            "{err}"
        );
        assert_eq!(record(b, a.id).await.status, JobStatus::InFlight);
        assert_eq!(record(b, other.id).await.status, JobStatus::InFlight);
    }

    /// A job whose cancel was requested while a holder had it is not run by the worker that
    /// takes it over: the claim says so.
    pub async fn a_takeover_sees_the_cancel_requested_of_the_last_holder<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let first = claim(b, 1).await.jobs.remove(0);
        assert!(!first.cancel_requested);
        assert_eq!(b.cancel(id).await.unwrap(), CancelOutcome::Requested);
        assert!(record(b, id).await.cancel_requested_at.is_some());
        h.advance_clock(lease().duration() + Duration::from_secs(1))
            .await;
        let taken = claim(b, 1).await.jobs.remove(0);
        assert_eq!(taken.id, id);
        assert!(taken.cancel_requested, "the takeover does not know of the cancel");
    }
}
