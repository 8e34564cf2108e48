//! Finalize hooks: they run after Applied only, and their failure rolls everything back.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use super::{Harness, claim, claim_then_take_over, enqueue, record};
use crate::backend::Backend;
use crate::error::{BoxError, Error};
use crate::hooks::{FinalizeEvent, FinalizeHook, Hooks, cancel_with_hooks, finalize_with_hooks};
use crate::types::{
    CANCELLED_BY_OPERATOR, CancelOutcome, Finalize, FinalizeOutcome, JobId, JobStatus, NewJob,
};

/// Records `(job, action kind)` of every applied finalize it sees.
#[derive(Clone, Default)]
pub(super) struct Recorder(pub(super) Arc<Mutex<Vec<(JobId, &'static str)>>>);

impl<Tx: Send, P: Sync> FinalizeHook<Tx, P> for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    async fn after_applied(
        &self,
        _tx: &mut Tx,
        event: &FinalizeEvent<'_, P>,
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
pub(super) struct StageFollowUp<B: Backend>(pub(super) B);

impl<B: Backend, P: Sync> FinalizeHook<B::Tx, P> for StageFollowUp<B> {
    fn name(&self) -> &str {
        "stage_follow_up"
    }
    async fn after_applied(
        &self,
        tx: &mut B::Tx,
        event: &FinalizeEvent<'_, P>,
    ) -> Result<(), BoxError> {
        if event.job.payload.get("follow_up_of").is_none() {
            let follow_up = NewJob::from_value(json!({ "follow_up_of": event.job.id.0 }));
            self.0.enqueue_in(tx, follow_up).await?;
        }
        Ok(())
    }
}

/// A domain guard that refuses every outcome.
struct Refuse;

impl<Tx: Send, P: Sync> FinalizeHook<Tx, P> for Refuse {
    fn name(&self) -> &str {
        "refuse"
    }
    async fn after_applied(
        &self,
        _tx: &mut Tx,
        _event: &FinalizeEvent<'_, P>,
    ) -> Result<(), BoxError> {
        Err("domain guard refused".into())
    }
}

cases! {
    $ __conformance_hooks;

    /// Hooks run after Applied only, in order, once.
    pub async fn hooks_run_only_after_applied<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let (old, new) = claim_then_take_over(&*h, id).await;
        let recorder = Recorder::default();
        let hooks = Hooks::<_, Value>::new()
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

    /// A failing hook rolls back the fenced write and every earlier hook's writes.
    pub async fn hook_error_rolls_back_the_whole_finalize<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let job = claim(b, 1).await.jobs.remove(0);
        let failing = Hooks::<_, Value>::new().with(StageFollowUp(b.clone())).with(Refuse);
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
        let fine = Hooks::<_, Value>::new().with(StageFollowUp(b.clone()));
        let outcome = finalize_with_hooks(b, &fine, &job, &Finalize::Complete)
            .await
            .unwrap();
        assert_eq!(outcome, FinalizeOutcome::Applied);
        assert_eq!(b.counts().await.unwrap().total(), 2);
    }

    /// An operator's cancel of a pending job runs the finalize hooks in its transaction (so
    /// domain state follows the job), and a hook error rolls the cancel back.
    pub async fn cancel_with_hooks_runs_them_for_a_pending_job<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = enqueue(b, 1).await;
        let refusing = Hooks::<_, Value>::new().with(Refuse);
        let err = cancel_with_hooks(b, &refusing, id).await.unwrap_err();
        assert!(matches!(&err, Error::Hook { hook, .. } if hook == "refuse"), "{err}");
        assert_eq!(record(b, id).await.status, JobStatus::Pending, "a failed cancel stuck");
        let recorder = Recorder::default();
        let hooks = Hooks::<_, Value>::new().with(recorder.clone());
        let outcome = cancel_with_hooks(b, &hooks, id).await.unwrap();
        assert_eq!(outcome, CancelOutcome::Cancelled);
        assert_eq!(*recorder.0.lock().unwrap(), vec![(id, "cancel")]);
        let rec = record(b, id).await;
        assert_eq!(rec.status, JobStatus::Cancelled);
        assert_eq!(rec.last_error.as_deref(), Some(CANCELLED_BY_OPERATOR));
        assert!(rec.finished_at.is_some());
        let again = cancel_with_hooks(b, &hooks, id).await.unwrap();
        assert_eq!(again, CancelOutcome::AlreadyTerminal(JobStatus::Cancelled));
        assert_eq!(recorder.0.lock().unwrap().len(), 1, "hooks ran for a job already ended");
    }
}
