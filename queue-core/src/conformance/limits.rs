//! Queue limits: at most so many jobs in flight, at most so many starts per window, enforced in
//! the claim for every claimer at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;

use super::{Harness, claim, lease};
use crate::admin::{Admin, QueueLimits, RateLimit};
use crate::backend::Backend;
use crate::error::{ConfigError, Error};
use crate::handler::{Handler, JobContext, JobError};
use crate::types::{ClaimRequest, Finalize, NewJob};
use crate::worker::{Worker, WorkerConfig};

struct Noop;

impl Handler for Noop {
    type Payload = serde_json::Value;
    async fn handle(&self, _ctx: JobContext, _p: serde_json::Value) -> Result<(), JobError> {
        Ok(())
    }
}

fn max_in_flight(n: u32) -> QueueLimits {
    QueueLimits {
        max_in_flight: Some(n),
        ..QueueLimits::NONE
    }
}

fn rate(starts: u32, per: Duration) -> QueueLimits {
    QueueLimits {
        rate: Some(RateLimit::new(starts, per).unwrap()),
        ..QueueLimits::NONE
    }
}

async fn enqueue_n<B: Backend>(b: &B, n: usize) {
    let jobs = (0..n)
        .map(|i| NewJob::from_value(json!({ "n": i })))
        .collect();
    b.enqueue_many(jobs).await.unwrap();
}

cases! {
    $ __conformance_limits;

    /// Limits are stored with the queue, shown by `control`, and removed with
    /// `QueueLimits::NONE`; a limit of 0 in flight is refused (that is a pause).
    pub async fn limits_are_stored_and_shown<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        assert_eq!(b.control().await.unwrap().limits, QueueLimits::NONE);
        let both = QueueLimits {
            max_in_flight: Some(8),
            rate: Some(RateLimit::new(100, Duration::from_secs(60)).unwrap()),
            max_per_partition: None,
            rate_per_partition: Some(RateLimit::new(5, Duration::from_millis(1500)).unwrap()),
        };
        assert_eq!(b.set_limits(both).await.unwrap().limits, both);
        assert_eq!(b.control().await.unwrap().limits, both);
        let other = h.other_queue(crate::types::QueueName::new("other").unwrap());
        assert_eq!(other.control().await.unwrap().limits, QueueLimits::NONE, "per queue");
        match b.set_limits(max_in_flight(0)).await {
            Err(Error::Config(ConfigError::OutOfRange { name, .. })) => {
                assert_eq!(name, "max_in_flight");
            }
            other => panic!("a limit of 0 must be refused, got {other:?}"),
        }
        assert_eq!(b.control().await.unwrap().limits, both, "the refusal changed nothing");
        assert!(b.set_limits(QueueLimits::NONE).await.unwrap().limits.is_none());
        assert!(RateLimit::new(0, Duration::from_secs(1)).is_err());
        assert!(RateLimit::new(1, Duration::ZERO).is_err());
    }

    /// A claim takes no more than the queue's room in flight; a finished job frees its slot,
    /// and jobs whose leases expired keep theirs but are taken over within the limit.
    pub async fn a_claim_takes_no_more_than_the_room_in_flight<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_n(b, 10).await;
        b.set_limits(max_in_flight(3)).await.unwrap();
        let first = claim(b, 10).await.jobs;
        assert_eq!(first.len(), 3);
        assert!(claim(b, 10).await.jobs.is_empty(), "the queue is full");
        assert!(b.finalize(first[0].claim(), &Finalize::Complete).await.unwrap().is_applied());
        assert_eq!(claim(b, 10).await.jobs.len(), 1, "one slot freed");

        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let after = claim(b, 10).await.jobs;
        assert_eq!(after.len(), 3, "the expired leases are taken over, and nothing more");
        assert!(after.iter().all(|job| job.taken_over), "{after:?}");
        assert_eq!(b.counts().await.unwrap().in_flight, 3);

        b.set_limits(QueueLimits::NONE).await.unwrap();
        assert_eq!(claim(b, 10).await.jobs.len(), 6, "no limit: the rest");
    }

    /// A holder may renew a lease that has passed while nobody took the job over: the job
    /// kept its slot, so a claim meanwhile may not fill it with another.
    pub async fn a_late_heartbeat_keeps_its_slot<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_n(b, 2).await;
        b.set_limits(max_in_flight(1)).await.unwrap();
        let held = claim(b, 10).await.jobs.remove(0);
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let renewed = b.extend_lease(held.claim(), lease()).await.unwrap();
        assert_eq!(renewed, crate::types::Heartbeat::Held, "nobody took it over");
        assert!(claim(b, 10).await.jobs.is_empty(), "the renewed job holds the one slot");
        assert_eq!(b.counts().await.unwrap().in_flight, 1);
    }

    /// Eight claimers at once, each finishing what it claimed: the queue never has more jobs
    /// in flight than its limit, sampled from the store all along, and every job runs.
    pub async fn concurrent_claimers_never_exceed_max_in_flight<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        enqueue_n(&b, 120).await;
        b.set_limits(max_in_flight(5)).await.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(AtomicU64::new(0));
        // How many samples the sampler has finished: the first claimer holds its first jobs
        // until a whole sample ran while it held them, so the sampler surely saw some in
        // flight (on a fast store it could otherwise sample only between claims).
        let (samples_tx, samples) = tokio::sync::watch::channel(0u64);
        let sampler = {
            let (b, done) = (b.clone(), done.clone());
            tokio::spawn(async move {
                let mut most = 0;
                while !done.load(Ordering::SeqCst) {
                    let in_flight = b.counts().await.unwrap().in_flight;
                    assert!(in_flight <= 5, "{in_flight} in flight, over the limit of 5");
                    most = most.max(in_flight);
                    samples_tx.send_modify(|n| *n += 1);
                    tokio::task::yield_now().await;
                }
                most
            })
        };
        let mut claimers = tokio::task::JoinSet::new();
        for claimer in 0..8 {
            let (b, finished) = (b.clone(), finished.clone());
            let mut samples = samples.clone();
            claimers.spawn(async move {
                let mut idle = 0;
                let mut seen_held = claimer != 0;
                while finished.load(Ordering::SeqCst) < 120 && idle < 10_000 {
                    let jobs = claim(&b, 3).await.jobs;
                    if jobs.is_empty() {
                        idle += 1;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    if !seen_held {
                        // A sample that began after this claim has ended: two more finished.
                        let after = *samples.borrow_and_update() + 2;
                        // An error: the sampler ended (its assertion failed), which the
                        // case reports below; go on rather than mask it.
                        let _ = samples.wait_for(|n| *n >= after).await;
                        seen_held = true;
                    }
                    tokio::task::yield_now().await;
                    for job in jobs {
                        let applied = b.finalize(job.claim(), &Finalize::Complete).await.unwrap();
                        assert!(applied.is_applied());
                        finished.fetch_add(1, Ordering::SeqCst);
                    }
                }
            });
        }
        claimers.join_all().await;
        done.store(true, Ordering::SeqCst);
        let most = sampler.await.unwrap();
        assert_eq!(finished.load(Ordering::SeqCst), 120, "every job ran");
        assert!(most >= 1, "the sampler saw jobs in flight");
        assert_eq!(b.counts().await.unwrap().completed, 120);
    }

    /// A worker whose claims come back short because of the queue's limits claims again as its
    /// own jobs end and free room, not at its next poll: with an hour's poll interval, one job
    /// in flight at a time and one partner at a time, twenty jobs still run at once.
    pub async fn a_worker_claims_again_as_its_jobs_free_room<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_n(b, 10).await;
        let partitioned = (0..10)
            .map(|i| NewJob::from_value(json!({ "p": i })).partition_key("partner"))
            .collect();
        b.enqueue_many(partitioned).await.unwrap();
        b.set_limits(QueueLimits {
            max_in_flight: Some(1),
            max_per_partition: Some(1),
            ..QueueLimits::NONE
        })
        .await
        .unwrap();
        let config = WorkerConfig {
            concurrency: 4,
            poll_interval: Duration::from_secs(3600),
            ..WorkerConfig::default()
        };
        let worker = Worker::new(b.clone(), Noop, config).unwrap().start();
        let stats = worker
            .wait_for_timeout(Duration::from_secs(30), |s| s.completed == 20)
            .await
            .unwrap_or_else(|last| panic!("the worker waited for its poll: {last:?}"));
        worker.shutdown().await.unwrap();
        assert_eq!(stats.completed, 20);
    }

    /// A rate limit allows so many claims per window, by the store's clock: the window slides,
    /// so starts it has let through count until they are older than the window.
    pub async fn the_rate_limit_allows_so_many_starts_per_window<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_n(b, 20).await;
        b.set_limits(rate(4, Duration::from_secs(60))).await.unwrap();
        let first = claim(b, 3).await.jobs;
        assert_eq!(first.len(), 3);
        h.advance_clock(Duration::from_secs(30)).await;
        assert_eq!(claim(b, 10).await.jobs.len(), 1, "4 per minute, 3 used");
        assert!(claim(b, 10).await.jobs.is_empty());
        h.advance_clock(Duration::from_secs(31)).await;
        assert_eq!(claim(b, 10).await.jobs.len(), 3, "the first 3 left the window");
        h.advance_clock(Duration::from_secs(30)).await;
        assert_eq!(claim(b, 10).await.jobs.len(), 1);
    }

    /// Sixteen claimers at once against a rate limit: exactly the limit's starts, no more.
    pub async fn concurrent_claimers_never_exceed_the_rate<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        enqueue_n(&b, 100).await;
        b.set_limits(rate(10, Duration::from_secs(3600))).await.unwrap();
        let mut claimers = tokio::task::JoinSet::new();
        for _ in 0..16 {
            let b = b.clone();
            claimers.spawn(async move {
                let mut got = 0;
                for _ in 0..4 {
                    got += b
                        .claim(ClaimRequest::new(2, lease()))
                        .await
                        .unwrap()
                        .jobs
                        .len();
                }
                got
            });
        }
        let claimed: usize = claimers.join_all().await.into_iter().sum();
        assert_eq!(claimed, 10, "an hour's starts, and no more");
        assert_eq!(b.counts().await.unwrap().in_flight, 10);
    }
}
