//! Enqueue, unique keys, transactions, and what `get` and `counts` report.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::{Harness, claim, enqueue, lease, record};
use crate::backend::{Backend, BackendTx};
use crate::error::Error;
use crate::limits::{DEFAULT_MAX_PAYLOAD_BYTES, MAX_UNIQUE_KEY_BYTES};
use crate::types::{
    ClaimRequest, Finalize, FinishedCounts, JobId, JobStatus, Lease, NewJob, QueueStats, RunAt,
};

cases! {
    $ __conformance_enqueue;

    /// `stats` reports the backlog (due, scheduled), the lag, leases expired and ending soon,
    /// and the jobs ended in the last hour, and nothing older.
    pub async fn stats_report_backlog_lag_leases_and_the_last_hour<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let minute = Duration::from_secs(60);
        assert_eq!(b.stats(minute).await.unwrap(), QueueStats::default());
        for _ in 0..3 {
            b.enqueue(NewJob::from_value(json!({}))).await.unwrap();
        }
        b.enqueue(NewJob::from_value(json!({})).run_at(RunAt::After(Duration::from_secs(3600))))
            .await
            .unwrap();
        h.advance_clock(Duration::from_secs(5)).await;
        let stats = b.stats(minute).await.unwrap();
        assert_eq!((stats.due, stats.scheduled, stats.in_flight), (3, 1, 0));
        let wait = stats.oldest_due_wait.expect("jobs are due");
        assert!(wait >= Duration::from_secs(5) && wait < minute, "{wait:?}");

        let lease = Lease::from_secs(30).unwrap();
        let claimed = b.claim(ClaimRequest::new(2, lease)).await.unwrap().jobs;
        let stats = b.stats(minute).await.unwrap();
        assert_eq!((stats.due, stats.in_flight), (1, 2));
        assert_eq!((stats.lease_expired, stats.lease_expiring), (0, 2));
        let soon = b.stats(Duration::from_secs(10)).await.unwrap();
        assert_eq!(soon.lease_expiring, 0, "leases of 30 s end within 10 s");

        let fail = Finalize::Fail { error: "no".into() };
        for (job, action) in claimed.iter().zip([Finalize::Complete, fail]) {
            assert!(b.finalize(job.claim(), &action).await.unwrap().is_applied());
        }
        let short = Lease::from_secs(10).unwrap();
        assert_eq!(b.claim(ClaimRequest::new(1, short)).await.unwrap().jobs.len(), 1);
        h.advance_clock(Duration::from_secs(11)).await;
        let stats = b.stats(minute).await.unwrap();
        assert_eq!((stats.due, stats.in_flight, stats.lease_expired), (0, 1, 1));
        assert_eq!(stats.oldest_due_wait, None);
        let finished = stats.finished_last_hour;
        assert_eq!((finished.completed, finished.failed), (1, 1));

        // Two hours on: the scheduled job is due and has waited about an hour; the outcomes are
        // older than the last hour.
        h.advance_clock(Duration::from_secs(2 * 3600)).await;
        let stats = b.stats(minute).await.unwrap();
        assert_eq!((stats.due, stats.scheduled), (1, 0));
        let wait = stats.oldest_due_wait.expect("the scheduled job is due");
        assert!(wait > Duration::from_secs(3500), "{wait:?}");
        assert_eq!(stats.finished_last_hour, FinishedCounts::default());
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

    /// A bulk enqueue (what PostgreSQL sends by `COPY`: ten thousand jobs or more, none with a
    /// unique key) keeps input order, stores each payload exactly (text a row format could
    /// mistake for a separator or an escape included), each priority and due time, and a job
    /// due later is not claimed early.
    pub async fn a_bulk_enqueue_stores_every_job_exactly<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let awkward = "tab\there, back\\slash \\N, new\nline, cr\r, quote \" é 🚀 \\.";
        // Due in the past, to the microsecond: claimed with the others, its instant kept.
        let at = DateTime::parse_from_rfc3339("2026-01-02T03:04:05.678901Z")
            .unwrap()
            .with_timezone(&Utc);
        let jobs: Vec<NewJob> = (0..10_500)
            .map(|n| {
                let job = NewJob::from_value(json!({ "n": n, "s": awkward, "null": null }));
                match n {
                    7 => job.priority(-3),
                    9 => job.run_at(RunAt::After(Duration::from_secs(3600))),
                    11 => job.run_at(RunAt::At(at)),
                    12 => job.partition_key(awkward),
                    _ => job,
                }
            })
            .collect();
        let ids = b.enqueue_many(jobs).await.unwrap();
        assert_eq!(ids.len(), 10_500);
        assert!(ids.iter().all(|e| !e.duplicate));
        assert!(ids.windows(2).all(|w| w[0].id < w[1].id), "ids in input order");
        for n in [0, 7, 9, 10_499] {
            let rec = record(b, ids[n].id).await;
            assert_eq!(rec.payload, json!({ "n": n, "s": awkward, "null": null }));
            assert_eq!(rec.status, JobStatus::Pending);
            assert_eq!(rec.priority, if n == 7 { -3 } else { 0 });
            assert_eq!(rec.partition_key, None);
        }
        assert_eq!(record(b, ids[11].id).await.next_attempt_at, at);
        assert_eq!(
            record(b, ids[12].id).await.partition_key.as_deref(),
            Some(awkward)
        );
        let claimed = b.claim(ClaimRequest::new(11_000, lease())).await.unwrap().jobs;
        assert_eq!(claimed.len(), 10_499, "the job due in an hour waits");
        assert!(claimed.iter().all(|j| j.id != ids[9].id));
        assert_eq!(b.counts().await.unwrap().pending, 1);
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

    /// A job no store could keep is refused with a typed error that says where, never what,
    /// and nothing of the call is inserted.
    pub async fn enqueue_refuses_values_no_store_can_keep<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let fine = || NewJob::from_value(json!({ "ok": true }));
        let bad = [
            NewJob::from_value(json!({ "card": "4111\u{0}1111" })),
            fine().unique_key("key\0"),
            fine().run_at(RunAt::After(Duration::MAX)),
            fine().run_at(RunAt::At(DateTime::<Utc>::MAX_UTC)),
            // Over the default payload limit, and a key longer than any index keeps.
            NewJob::from_value(json!({ "blob": "4111".repeat(DEFAULT_MAX_PAYLOAD_BYTES / 4) })),
            fine().unique_key("4111".repeat(MAX_UNIQUE_KEY_BYTES)),
        ];
        for job in bad {
            let err = b.enqueue(job.clone()).await.unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "{err}");
            assert!(!err.to_string().contains("4111"), "{err}");
            let err = b.enqueue_many(vec![fine(), job.clone()]).await.unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "{err}");
            let mut tx = b.begin().await.unwrap();
            let err = b.enqueue_in(&mut tx, job).await.unwrap_err();
            assert!(matches!(err, Error::Invalid(_)), "{err}");
            tx.rollback().await.unwrap();
        }
        assert_eq!(b.counts().await.unwrap().total(), 0, "a refused call inserted");
    }
}
