//! Partitions: a limit per partition key (`QueueLimits::max_per_partition`), enforced in the
//! claim for every claimer at once, with partitions taking turns (`crate::partition`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use serde_json::json;

use super::{Harness, claim, lease, record};
use crate::admin::{Admin, JobFilter, QueueLimits, RateLimit};
use crate::backend::Backend;
use crate::error::{ConfigError, Error, InvalidInput};
use crate::types::{ClaimedJob, Finalize, JobId, JobStatus, NewJob};

fn per_partition(n: u32) -> QueueLimits {
    QueueLimits {
        max_per_partition: Some(n),
        ..QueueLimits::NONE
    }
}

fn rate_per_partition(starts: u32, per: Duration) -> QueueLimits {
    QueueLimits {
        rate_per_partition: Some(RateLimit::new(starts, per).unwrap()),
        ..QueueLimits::NONE
    }
}

/// How many of `jobs` are of each partition (`""`: none).
async fn per_key<B: Backend>(
    b: &B,
    jobs: &[ClaimedJob],
) -> std::collections::BTreeMap<String, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for key in partitions_of(b, jobs).await {
        *counts.entry(key.unwrap_or_default()).or_default() += 1;
    }
    counts
}

fn counts<const N: usize>(pairs: [(&str, usize); N]) -> std::collections::BTreeMap<String, usize> {
    pairs.into_iter().map(|(k, n)| (k.to_owned(), n)).collect()
}

fn job(key: Option<&str>, n: usize) -> NewJob {
    let job = NewJob::from_value(json!({ "n": n }));
    match key {
        Some(key) => job.partition_key(key),
        None => job,
    }
}

/// Enqueues `n` jobs of partition `key` (one call), returning their ids in order.
async fn enqueue_in<B: Backend>(b: &B, key: Option<&str>, n: usize) -> Vec<JobId> {
    let jobs = (0..n).map(|i| job(key, i)).collect();
    let done = b.enqueue_many(jobs).await.unwrap();
    done.into_iter().map(|e| e.id).collect()
}

/// The partition of each claimed job.
async fn partitions_of<B: Backend>(b: &B, jobs: &[ClaimedJob]) -> Vec<Option<String>> {
    let mut keys = Vec::new();
    for job in jobs {
        keys.push(record(b, job.id).await.partition_key);
    }
    keys
}

/// Sixteen claimers at once, each claiming two jobs four times and finishing them at once (so
/// that only the rates hold them back); every job they took.
async fn claim_and_complete_at_once<B: Backend + Clone + 'static>(b: &B) -> Vec<ClaimedJob> {
    let mut claimers = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let b = b.clone();
        claimers.spawn(async move {
            let mut got = Vec::new();
            for _ in 0..4 {
                let jobs = claim(&b, 2).await.jobs;
                complete(&b, &jobs).await;
                got.extend(jobs);
            }
            got
        });
    }
    claimers.join_all().await.into_iter().flatten().collect()
}

/// Clears its flag when dropped: when the task holding it ends, even by a panic.
struct StopsOnDrop(Arc<AtomicBool>);

impl Drop for StopsOnDrop {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

async fn complete<B: Backend>(b: &B, jobs: &[ClaimedJob]) {
    for job in jobs {
        let outcome = b.finalize(job.claim(), &Finalize::Complete).await.unwrap();
        assert!(outcome.is_applied(), "{job:?}");
    }
}

cases! {
    $ __conformance_partitions;

    /// A job's partition key is stored and shown; one no store could keep is refused with its
    /// reason, and nothing of its call is stored. The limit per partition is stored with the
    /// queue's other limits, and a limit of 0 is refused.
    pub async fn partition_keys_and_limits_are_stored_and_checked<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let id = b.enqueue(job(Some("partner-7"), 0)).await.unwrap().id;
        assert_eq!(record(b, id).await.partition_key.as_deref(), Some("partner-7"));
        let listed = b.list_jobs(&JobFilter::new()).await.unwrap();
        assert_eq!(listed.jobs[0].partition_key.as_deref(), Some("partner-7"));
        let plain = b.enqueue(job(None, 1)).await.unwrap().id;
        assert_eq!(record(b, plain).await.partition_key, None);

        let refused = b.enqueue_many(vec![job(Some("fine"), 2), job(Some("nul\0key"), 3)]).await;
        assert!(
            matches!(refused, Err(Error::Invalid(InvalidInput::PartitionKeyNul))),
            "{refused:?}"
        );
        let long = "p".repeat(crate::limits::MAX_PARTITION_KEY_BYTES + 1);
        let refused = b.enqueue(job(Some(&long), 4)).await;
        assert!(
            matches!(refused, Err(Error::Invalid(InvalidInput::PartitionKeyLength { .. }))),
            "{refused:?}"
        );
        assert_eq!(b.counts().await.unwrap().pending, 2, "the refused calls stored nothing");

        let limits = QueueLimits { max_in_flight: Some(5), ..per_partition(2) };
        assert_eq!(b.set_limits(limits).await.unwrap().limits, limits);
        assert_eq!(b.control().await.unwrap().limits, limits);
        match b.set_limits(per_partition(0)).await {
            Err(Error::Config(ConfigError::OutOfRange { name, .. })) => {
                assert_eq!(name, "max_per_partition");
            }
            other => panic!("a limit of 0 per partition must be refused, got {other:?}"),
        }
        assert_eq!(b.control().await.unwrap().limits, limits, "the refusal changed nothing");
    }

    /// A partition at its limit is passed over: the partitions behind it and the jobs without a
    /// partition are claimed, its own next job waits until one of its jobs ends. An expired
    /// lease keeps its slot and is taken over for free.
    pub async fn a_partition_at_its_limit_does_not_hold_back_the_others<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let a = enqueue_in(b, Some("a"), 5).await;
        let bee = enqueue_in(b, Some("b"), 1).await;
        let loose = enqueue_in(b, None, 1).await;
        b.set_limits(per_partition(1)).await.unwrap();

        let first = claim(b, 10).await.jobs;
        let mut ids: Vec<JobId> = first.iter().map(|j| j.id).collect();
        ids.sort();
        assert_eq!(ids, [a[0], bee[0], loose[0]], "one of a, one of b, the loose job");
        assert!(claim(b, 10).await.jobs.is_empty(), "a and b are at their limit");

        let a0 = first.iter().find(|j| j.id == a[0]).unwrap();
        complete(b, std::slice::from_ref(a0)).await;
        let next = claim(b, 10).await.jobs;
        assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), [a[1]], "a's slot freed");

        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let again = claim(b, 10).await.jobs;
        assert_eq!(again.len(), 3, "the three expired leases, and nothing new: {again:?}");
        assert!(again.iter().all(|j| j.taken_over));
        assert_eq!(b.counts().await.unwrap().in_flight, 3);
    }

    /// While no partition is at its limit, jobs run in the usual order; once one is, the
    /// partitions take turns in key order from where the last claim stopped, whatever order
    /// the jobs were enqueued in.
    pub async fn partitions_take_turns_once_one_is_at_its_limit<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        for key in ["k0", "k1", "k2", "k3"] {
            enqueue_in(b, Some(key), 3).await;
        }
        b.set_limits(per_partition(1)).await.unwrap();
        // One at a time, each finished before the next: no limit is ever reached.
        let jobs = claim(b, 1).await.jobs;
        assert_eq!(partitions_of(b, &jobs).await, [Some("k0".to_owned())]);
        complete(b, &jobs).await;
        // Two at a time, held: the two earliest are both k0's, so the partitions take turns.
        let mut rounds = Vec::new();
        for _ in 0..5 {
            let first = claim(b, 2).await.jobs;
            let second = claim(b, 2).await.jobs;
            let mut round = partitions_of(b, &first).await;
            round.extend(partitions_of(b, &second).await);
            rounds.push(round.into_iter().flatten().collect::<Vec<_>>());
            complete(b, &first).await;
            complete(b, &second).await;
        }
        let turn = |keys: [&str; 4]| keys.map(str::to_owned).to_vec();
        assert_eq!(
            rounds,
            [
                turn(["k0", "k1", "k2", "k3"]),
                turn(["k0", "k1", "k2", "k3"]),
                // k0 is done; the last three fit as they are.
                vec!["k1".to_owned(), "k2".to_owned(), "k3".to_owned()],
                vec![],
                vec![],
            ]
        );
    }

    /// When a claim whose partitions take turns fills its batch with earlier jobs, and a
    /// partition it visited had nothing taken, that partition keeps its turn: the next claim
    /// starts with it, not after the last partition visited.
    pub async fn a_partition_whose_offer_was_not_taken_keeps_its_turn<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let a = enqueue_in(b, Some("a"), 2).await;
        let loose = enqueue_in(b, None, 2).await;
        let mut later = Vec::new();
        for key in ["b", "c", "d"] {
            later.extend(enqueue_in(b, Some(key), 1).await);
        }
        b.set_limits(per_partition(1)).await.unwrap();
        // The earliest three are a's two and a loose job: a would have two, so the walk visits
        // a, b and c, and the batch takes a's first and the two loose jobs, earlier than b's
        // and c's.
        let first = claim(b, 3).await.jobs;
        let mut ids: Vec<JobId> = first.iter().map(|j| j.id).collect();
        ids.sort();
        assert_eq!(ids, [a[0], loose[0], loose[1]]);
        // a is at its limit; b, visited and passed over, comes first.
        let next = claim(b, 1).await.jobs;
        assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), [later[0]], "b kept its turn");
    }

    /// While partitions take turns, the takeovers of expired leases are merged with the
    /// partitions' offers in claim order, the same on every store.
    pub async fn takeovers_and_turns_share_one_claim_order<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let long = crate::types::Lease::from_secs(3600).unwrap();
        enqueue_in(b, Some("z"), 1).await;
        let expiring = claim(b, 1).await.jobs;
        assert_eq!(partitions_of(b, &expiring).await, [Some("z".to_owned())]);
        enqueue_in(b, Some("x"), 3).await;
        b.set_limits(per_partition(1)).await.unwrap();
        let first = b.claim(crate::types::ClaimRequest::new(2, long)).await.unwrap().jobs;
        assert_eq!(partitions_of(b, &first).await, [Some("x".to_owned())], "x at one");
        complete(b, &first).await;
        let w = enqueue_in(b, Some("w"), 1).await;
        let y = enqueue_in(b, Some("y"), 1).await;
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        // The earliest two due are x's: the partitions take turns from after x: y, then w.
        // In claim order the expired z comes first, then w (enqueued before y).
        let jobs = b.claim(crate::types::ClaimRequest::new(2, long)).await.unwrap().jobs;
        let taken: Vec<(JobId, bool)> = jobs.iter().map(|j| (j.id, j.taken_over)).collect();
        assert_eq!(taken, [(expiring[0].id, true), (w[0], false)]);
        // x's next job fits as it is (x has none in flight); then x is at its limit, and y,
        // passed over for earlier jobs, is next.
        let next = b.claim(crate::types::ClaimRequest::new(1, long)).await.unwrap().jobs;
        assert_eq!(partitions_of(b, &next).await, [Some("x".to_owned())]);
        let next = b.claim(crate::types::ClaimRequest::new(1, long)).await.unwrap().jobs;
        assert_eq!(next.iter().map(|j| j.id).collect::<Vec<_>>(), [y[0]]);
    }

    /// Eight claimers at once, each finishing what it claimed: no partition ever has more jobs
    /// in flight than its limit, sampled from the store all along, and every job runs.
    pub async fn concurrent_claimers_never_exceed_the_partition_limit<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        let keys = ["p0", "p1", "p2", "p3", "p4", "p5"];
        for key in keys {
            enqueue_in(&b, Some(key), 15).await;
        }
        enqueue_in(&b, None, 10).await;
        let total = 100;
        b.set_limits(per_partition(2)).await.unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let finished = Arc::new(AtomicU64::new(0));
        // Samples taken: a claimer holds its jobs until the next sample, so the sampler sees
        // them in flight however fast the store is (and until the sampler stopped, so a failed
        // sample ends the case instead of stalling it).
        let samples = Arc::new(AtomicU64::new(0));
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let (b, done, samples) = (b.clone(), done.clone(), samples.clone());
            let stopped = StopsOnDrop(sampling.clone());
            tokio::spawn(async move {
                let _stopped = stopped;
                let mut most = 0;
                let running = JobFilter::new().status(JobStatus::InFlight).limit(1_000);
                while !done.load(Ordering::SeqCst) {
                    let mut per: HashMap<String, usize> = HashMap::new();
                    for job in b.list_jobs(&running).await.unwrap().jobs {
                        if let Some(key) = job.partition_key {
                            *per.entry(key).or_default() += 1;
                        }
                    }
                    for (key, n) in &per {
                        assert!(*n <= 2, "{n} jobs of {key} in flight, over the limit of 2");
                        most = most.max(*n);
                    }
                    samples.fetch_add(1, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                }
                most
            })
        };
        let mut claimers = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (b, finished, samples) = (b.clone(), finished.clone(), samples.clone());
            let sampling = sampling.clone();
            claimers.spawn(async move {
                let mut idle = 0;
                while finished.load(Ordering::SeqCst) < total && idle < 10_000 {
                    let jobs = claim(&b, 3).await.jobs;
                    if jobs.is_empty() {
                        idle += 1;
                        tokio::task::yield_now().await;
                        continue;
                    }
                    let seen = samples.load(Ordering::SeqCst);
                    while samples.load(Ordering::SeqCst) < seen + 2
                        && sampling.load(Ordering::SeqCst)
                    {
                        tokio::task::yield_now().await;
                    }
                    complete(&b, &jobs).await;
                    finished.fetch_add(jobs.len() as u64, Ordering::SeqCst);
                }
            });
        }
        claimers.join_all().await;
        done.store(true, Ordering::SeqCst);
        let most = sampler.await.unwrap();
        assert_eq!(finished.load(Ordering::SeqCst), total, "every job ran");
        assert!(most >= 1, "the sampler saw partitioned jobs in flight");
        assert_eq!(b.counts().await.unwrap().completed, total);
    }

    /// The queue's own limits hold beside the partitions': with two in flight per partition and
    /// three in the queue, a claim takes three.
    pub async fn the_queue_limit_holds_beside_the_partition_limit<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        for key in ["a", "b", "c"] {
            enqueue_in(b, Some(key), 4).await;
        }
        b.set_limits(QueueLimits { max_in_flight: Some(3), ..per_partition(2) }).await.unwrap();
        let jobs = claim(b, 10).await.jobs;
        assert_eq!(jobs.len(), 3);
        let mut keys = partitions_of(b, &jobs).await;
        keys.sort();
        keys.dedup();
        assert!(keys.len() >= 2, "no partition got more than two: {keys:?}");
        assert!(claim(b, 10).await.jobs.is_empty());
        b.set_limits(per_partition(2)).await.unwrap();
        assert_eq!(claim(b, 10).await.jobs.len(), 3, "two per partition: three more");
    }

    /// A rate per partition allows so many claims of each partition's jobs per window, by the
    /// store's clock, the window sliding; jobs without a partition are not limited by it, and
    /// a partition whose starts are used does not hold back the others. The rate is stored and
    /// shown with the queue's other limits.
    pub async fn the_partition_rate_allows_so_many_starts_per_window<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_in(b, Some("a"), 6).await;
        enqueue_in(b, Some("b"), 6).await;
        enqueue_in(b, None, 2).await;
        let limits = rate_per_partition(2, Duration::from_secs(60));
        assert_eq!(b.set_limits(limits).await.unwrap().limits, limits);
        assert_eq!(b.control().await.unwrap().limits, limits);

        let first = claim(b, 10).await.jobs;
        assert_eq!(per_key(b, &first).await, counts([("", 2), ("a", 2), ("b", 2)]));
        // Finished at once: the rate counts starts, not jobs in flight.
        complete(b, &first).await;
        assert!(claim(b, 10).await.jobs.is_empty(), "each partition used its two starts");
        h.advance_clock(Duration::from_secs(30)).await;
        assert!(claim(b, 10).await.jobs.is_empty(), "still within the minute");
        h.advance_clock(Duration::from_secs(31)).await;
        let next = claim(b, 3).await.jobs;
        assert_eq!(next.len(), 3);
        let more = claim(b, 10).await.jobs;
        let mut all = next.clone();
        all.extend(more);
        assert_eq!(per_key(b, &all).await, counts([("a", 2), ("b", 2)]), "the window slid");
        assert_eq!(b.counts().await.unwrap().pending, 4);
    }

    /// A takeover of an expired lease is a start of its partition too: the partition's
    /// takeovers and new jobs together stay within its rate, the takeover first (claim order).
    pub async fn takeovers_count_against_the_partition_rate<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let a = enqueue_in(b, Some("a"), 4).await;
        b.set_limits(rate_per_partition(3, Duration::from_secs(3600))).await.unwrap();
        let first = claim(b, 1).await.jobs;
        assert_eq!(first.iter().map(|j| j.id).collect::<Vec<_>>(), [a[0]]);
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        let again = claim(b, 10).await.jobs;
        let taken: Vec<(JobId, bool)> = again.iter().map(|j| (j.id, j.taken_over)).collect();
        assert_eq!(taken, [(a[0], true), (a[1], false)], "three starts of a in the hour");
        h.advance_clock(lease().duration() + Duration::from_secs(1)).await;
        assert!(claim(b, 10).await.jobs.is_empty(), "no takeover past the rate either");
        assert_eq!(b.counts().await.unwrap().in_flight, 2);
    }

    /// A partition with no start left does not hold back other partitions' takeovers: its own
    /// expired leases, however many and however early, are passed over, not counted into the
    /// batch and then dropped.
    pub async fn takeovers_pass_a_partition_out_of_starts<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let minute = crate::types::Lease::from_secs(60).unwrap();
        let two = crate::types::Lease::from_secs(120).unwrap();
        let p = enqueue_in(b, Some("p"), 3).await;
        let r = enqueue_in(b, Some("r"), 1).await;
        // Claimed before the rate was set: none of these starts is counted.
        let first = b.claim(crate::types::ClaimRequest::new(3, minute)).await.unwrap().jobs;
        assert_eq!(first.iter().map(|j| j.id).collect::<Vec<_>>(), p);
        let later = b.claim(crate::types::ClaimRequest::new(1, two)).await.unwrap().jobs;
        assert_eq!(later.iter().map(|j| j.id).collect::<Vec<_>>(), r);
        b.set_limits(rate_per_partition(1, Duration::from_secs(3600))).await.unwrap();
        h.advance_clock(Duration::from_secs(61)).await;
        let retaken = b.claim(crate::types::ClaimRequest::new(10, minute)).await.unwrap().jobs;
        let taken: Vec<(JobId, bool)> = retaken.iter().map(|j| (j.id, j.taken_over)).collect();
        assert_eq!(taken, [(p[0], true)], "p's one start of the hour");
        h.advance_clock(Duration::from_secs(61)).await;
        // Every lease has passed; p's three expired first, but p has no start left.
        let next = b.claim(crate::types::ClaimRequest::new(1, minute)).await.unwrap().jobs;
        let taken: Vec<(JobId, bool)> = next.iter().map(|j| (j.id, j.taken_over)).collect();
        assert_eq!(taken, [(r[0], true)], "r's takeover is not held back by p's");
    }

    /// A rate per partition and a limit in flight per partition together: a partition takes
    /// what both leave.
    pub async fn the_partition_rate_holds_beside_the_partition_limit<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        enqueue_in(b, Some("a"), 5).await;
        enqueue_in(b, Some("b"), 5).await;
        let limits = QueueLimits {
            rate_per_partition: Some(RateLimit::new(3, Duration::from_secs(60)).unwrap()),
            ..per_partition(2)
        };
        b.set_limits(limits).await.unwrap();
        let first = claim(b, 10).await.jobs;
        assert_eq!(per_key(b, &first).await, counts([("a", 2), ("b", 2)]), "two in flight each");
        complete(b, &first).await;
        let second = claim(b, 10).await.jobs;
        assert_eq!(per_key(b, &second).await, counts([("a", 1), ("b", 1)]), "one start left each");
        complete(b, &second).await;
        assert!(claim(b, 10).await.jobs.is_empty());
        h.advance_clock(Duration::from_secs(61)).await;
        let third = claim(b, 10).await.jobs;
        assert_eq!(per_key(b, &third).await, counts([("a", 2), ("b", 2)]));
    }

    /// Sixteen claimers at once against a rate per partition: each partition's starts are
    /// exactly its rate, no more, and the jobs without a partition all run.
    pub async fn concurrent_claimers_never_exceed_the_partition_rate<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        // The jobs without a partition first: behind a backlog of partitioned jobs longer than
        // the claim's read-ahead they would wait for it (crate::partition).
        enqueue_in(&b, None, 5).await;
        for key in ["p0", "p1", "p2", "p3"] {
            enqueue_in(&b, Some(key), 10).await;
        }
        b.set_limits(rate_per_partition(3, Duration::from_secs(3600))).await.unwrap();
        let claimed = claim_and_complete_at_once(&b).await;
        assert_eq!(
            per_key(&b, &claimed).await,
            counts([("", 5), ("p0", 3), ("p1", 3), ("p2", 3), ("p3", 3)]),
            "an hour's starts of each partition, and no more"
        );
    }

    /// Claims made while the whole queue is far under its rate per partition still count
    /// against each partition once it nears the rate (a store may skip the count per partition
    /// while no partition can reach the rate, never the starts themselves).
    pub async fn starts_far_under_the_partition_rate_still_count<H: Harness>(h: Arc<H>) {
        let b = h.backend();
        let a = enqueue_in(b, Some("a"), 6).await;
        let other = enqueue_in(b, Some("b"), 2).await;
        b.set_limits(rate_per_partition(4, Duration::from_secs(60))).await.unwrap();
        let ids = |jobs: &[ClaimedJob]| jobs.iter().map(|j| j.id).collect::<Vec<_>>();
        let first = claim(b, 1).await.jobs;
        assert_eq!(ids(&first), [a[0]]);
        complete(b, &first).await;
        // A quiet minute: the queue made one start in the last two.
        h.advance_clock(Duration::from_secs(61)).await;
        for expected in &a[1..5] {
            let jobs = claim(b, 1).await.jobs;
            assert_eq!(ids(&jobs), [*expected], "a's starts 1 to 4 of this minute");
            complete(b, &jobs).await;
        }
        let next = claim(b, 1).await.jobs;
        assert_eq!(ids(&next), [other[0]], "a has no start left this minute");
        complete(b, &next).await;
        let rest = claim(b, 10).await.jobs;
        assert_eq!(ids(&rest), [other[1]], "nor for a claim of many");
        complete(b, &rest).await;
        h.advance_clock(Duration::from_secs(61)).await;
        assert_eq!(ids(&claim(b, 10).await.jobs), [a[5]], "the window slid");
    }

    /// Sixteen claimers at once after a quiet window, against a rate per partition that the
    /// first claims cannot reach and the later ones can: each partition's starts are exactly
    /// its rate, however the claims before and after the rate came near were counted.
    pub async fn concurrent_claimers_after_a_quiet_window_never_exceed_the_partition_rate<H: Harness>(h: Arc<H>) {
        let b = h.backend().clone();
        for key in ["p0", "p1", "p2", "p3"] {
            enqueue_in(&b, Some(key), 20).await;
        }
        b.set_limits(rate_per_partition(6, Duration::from_secs(60))).await.unwrap();
        let first = claim(&b, 1).await.jobs;
        complete(&b, &first).await;
        h.advance_clock(Duration::from_secs(61)).await;
        let claimed = claim_and_complete_at_once(&b).await;
        assert_eq!(
            per_key(&b, &claimed).await,
            counts([("p0", 6), ("p1", 6), ("p2", 6), ("p3", 6)]),
            "a minute's starts of each partition, and no more"
        );
    }
}
