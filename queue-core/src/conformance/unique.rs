//! Unique keys with a scope: held only while in given statuses, only for a period, and
//! duplicates that replace a pending holder (debounce); what is refused; concurrent enqueues of
//! one key.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::{Harness, claim, record};
use crate::admin::Admin;
use crate::backend::{Backend, BackendTx};
use crate::error::{Error, InvalidInput};
use crate::types::{Finalize, JobStatus, NewJob, RunAt, UniqueScope};

fn keyed(n: i64) -> NewJob {
    NewJob::from_value(json!({ "n": n })).unique_key("sync:7")
}

cases! {
    $ __conformance_unique;

    /// A key held while unfinished is a duplicate while its job waits or runs, and free again
    /// once the job has finished: the next enqueue inserts a new job, and the finished one
    /// keeps its row without the key.
    pub async fn a_key_held_while_unfinished_is_free_once_finished<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let scoped = |n| keyed(n).unique_while(&UniqueScope::UNFINISHED);
        let first = b.enqueue(scoped(1)).await.unwrap();
        assert!(!first.duplicate);
        let waiting = b.enqueue(scoped(2)).await.unwrap();
        assert_eq!((waiting.id, waiting.duplicate), (first.id, true));
        let job = claim(b, 1).await.jobs.remove(0);
        let running = b.enqueue(scoped(3)).await.unwrap();
        assert_eq!((running.id, running.duplicate), (first.id, true));
        assert!(b.finalize(job.claim(), &Finalize::Complete).await.unwrap().is_applied());

        let next = b.enqueue(scoped(4)).await.unwrap();
        assert!(!next.duplicate, "a completed holder gave its key up");
        assert_ne!(next.id, first.id);
        let old = record(b, first.id).await;
        assert_eq!((old.status, old.unique_key), (JobStatus::Completed, None));
        assert_eq!(old.payload, json!({ "n": 1 }));
        let holder = b.find_by_unique_key("sync:7").await.unwrap().expect("the new holder");
        assert_eq!((holder.id, holder.payload), (next.id, json!({ "n": 4 })));

        // A job of the default scope still meets the new holder, and a default-scope holder
        // keeps its key against nobody but scoped enqueues that exclude its status.
        let plain = b.enqueue(keyed(5)).await.unwrap();
        assert_eq!((plain.id, plain.duplicate), (next.id, true));
        assert_eq!(b.counts().await.unwrap().pending, 1);
    }

    /// A key held for a period is a duplicate within it and free after it, by the backend's
    /// clock.
    pub async fn a_key_held_for_a_period_is_free_after_it<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let hourly = |n| keyed(n).unique_for(Duration::from_secs(3600));
        let first = b.enqueue(hourly(1)).await.unwrap();
        h.advance_clock(Duration::from_secs(3500)).await;
        let within = b.enqueue(hourly(2)).await.unwrap();
        assert_eq!((within.id, within.duplicate), (first.id, true));
        h.advance_clock(Duration::from_secs(101)).await;
        let after = b.enqueue(hourly(3)).await.unwrap();
        assert!(!after.duplicate, "the period has passed");
        assert_eq!(record(b, first.id).await.unique_key, None);
        assert_eq!(b.counts().await.unwrap().pending, 2, "the old job still runs");
    }

    /// A replacing duplicate gives a pending holder its payload, priority and due time (a
    /// debounce); a holder a worker has claimed keeps what it runs with, and the enqueue
    /// reports a plain duplicate.
    pub async fn a_replacing_duplicate_updates_the_pending_holder<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let later = RunAt::After(Duration::from_secs(3600));
        let first = b.enqueue(keyed(1).run_at(later)).await.unwrap();
        assert!(claim(b, 1).await.jobs.is_empty(), "not due for an hour");

        let replacing = keyed(2).priority(-3).replace_pending();
        let second = b.enqueue(replacing).await.unwrap();
        assert_eq!((second.id, second.duplicate, second.replaced), (first.id, true, true));
        let held = record(b, first.id).await;
        assert_eq!((held.payload, held.priority), (json!({ "n": 2 }), -3));
        let job = claim(b, 1).await.jobs.remove(0);
        assert_eq!((job.id, &job.payload), (first.id, &json!({ "n": 2 })), "due now");

        let third = b.enqueue(keyed(3).replace_pending()).await.unwrap();
        assert_eq!((third.id, third.duplicate, third.replaced), (first.id, true, false));
        assert_eq!(record(b, first.id).await.payload, json!({ "n": 2 }));
        assert_eq!(b.counts().await.unwrap().total(), 1);

        // Replacing only while pending: the running holder gives its key up instead, and the
        // new job waits for its own turn (debounce behind a running job).
        let behind = keyed(4)
            .unique_while(&[JobStatus::Pending])
            .replace_pending();
        let fourth = b.enqueue(behind).await.unwrap();
        assert!(!fourth.duplicate && !fourth.replaced);
        assert!(b.finalize(job.claim(), &Finalize::Complete).await.unwrap().is_applied());
        assert_eq!(record(b, fourth.id).await.payload, json!({ "n": 4 }));
    }

    /// A scoped enqueue in a transaction rolls back whole: the released key and the replaced
    /// values come back.
    pub async fn a_scoped_enqueue_rolls_back_with_its_transaction<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let first = b.enqueue(keyed(1)).await.unwrap();
        let mut tx = b.begin().await.unwrap();
        let replaced = b
            .enqueue_in(&mut tx, keyed(2).replace_pending())
            .await
            .unwrap();
        assert!(replaced.replaced);
        tx.rollback().await.unwrap();
        assert_eq!(record(b, first.id).await.payload, json!({ "n": 1 }));

        let mut tx = b.begin().await.unwrap();
        let fresh = b
            .enqueue_in(&mut tx, keyed(3).unique_while(&[JobStatus::InFlight]))
            .await
            .unwrap();
        assert!(!fresh.duplicate, "a pending holder is out of an in-flight scope");
        tx.rollback().await.unwrap();
        let holder = b.find_by_unique_key("sync:7").await.unwrap().expect("kept");
        assert_eq!(holder.id, first.id, "the rolled-back release is undone");
        assert_eq!(b.counts().await.unwrap().total(), 1);
    }

    /// Scopes that mean nothing, or that one call cannot apply in a defined order, are refused
    /// before anything is written.
    pub async fn a_unique_scope_the_store_cannot_apply_is_refused<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        fn refused<T: std::fmt::Debug>(result: crate::Result<T>) -> InvalidInput {
            match result {
                Err(Error::Invalid(invalid)) => invalid,
                other => panic!("expected a refusal, got {other:?}"),
            }
        }
        let no_key = NewJob::from_value(json!({})).replace_pending();
        assert_eq!(refused(b.enqueue(no_key).await), InvalidInput::UniqueScopeWithoutKey);
        assert_eq!(
            refused(b.enqueue(keyed(1).unique_while(&[])).await),
            InvalidInput::UniqueScopeEmpty
        );
        let century = Duration::from_secs(200 * 365 * 24 * 3600);
        assert_eq!(
            refused(b.enqueue(keyed(1).unique_for(century)).await),
            InvalidInput::UniquePeriodTooLong(century)
        );
        let repeated = vec![
            NewJob::from_value(json!({})).unique_key("other"),
            keyed(1),
            keyed(2).replace_pending(),
        ];
        assert_eq!(
            refused(b.enqueue_many(repeated).await.map(|_| ())),
            InvalidInput::RepeatedScopedKey { first: 1, second: 2 }
        );
        assert_eq!(b.counts().await.unwrap().total(), 0, "nothing was written");
    }

    /// Concurrent enqueues of one key insert one job, whether each would release a finished
    /// holder's key or replace a pending holder's values.
    pub async fn concurrent_scoped_enqueues_of_one_key_insert_once<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        let finished = b.enqueue(keyed(0)).await.unwrap().id;
        let job = claim(&b, 1).await.jobs.remove(0);
        assert!(b.finalize(job.claim(), &Finalize::Complete).await.unwrap().is_applied());

        let mut racers = tokio::task::JoinSet::new();
        for n in 1..=16 {
            let b = b.clone();
            racers.spawn(async move {
                let job = keyed(n)
                    .unique_while(&UniqueScope::UNFINISHED)
                    .replace_pending();
                b.enqueue(job).await.unwrap()
            });
        }
        let results = racers.join_all().await;
        let inserted: Vec<_> = results.iter().filter(|e| !e.duplicate).collect();
        assert_eq!(inserted.len(), 1, "{results:?}");
        let holder = inserted[0].id;
        assert!(results.iter().all(|e| e.id == holder), "{results:?}");
        assert_eq!(b.counts().await.unwrap().pending, 1);
        assert_eq!(record(&b, finished).await.unique_key, None);
        let held = b.find_by_unique_key("sync:7").await.unwrap().expect("one holder");
        assert_eq!(held.id, holder);
    }
}
