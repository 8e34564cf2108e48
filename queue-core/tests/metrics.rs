//! The worker's metrics equal what happened: a run with known outcomes (completions, a failure,
//! a malformed payload, a retry, a takeover of an expired lease, a write refused by the fence),
//! read back from a recorder installed for this test binary alone.

use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use queue_core::metrics::{self, QUEUE_LABEL};
use queue_core::{
    Backend, ClaimRequest, Handler, JobContext, JobError, Lease, MemoryBackend, NewJob, QueueName,
    RetryPolicy, Worker, WorkerConfig,
};
use serde_json::json;
use tokio::sync::Notify;

#[derive(serde::Deserialize)]
struct Step {
    kind: String,
}

struct Steps {
    started: Arc<Notify>,
    release: Arc<Notify>,
}

impl Handler for Steps {
    type Payload = Step;
    async fn handle(&self, ctx: JobContext, step: Step) -> Result<(), JobError> {
        match step.kind.as_str() {
            "fail" => Err(JobError::fail("refused")),
            "retry-once" if ctx.attempts() == 1 => Err(JobError::retry("not yet")),
            "hang" => {
                self.started.notify_one();
                self.release.notified().await;
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn config(concurrency: usize, poll: Duration) -> WorkerConfig {
    WorkerConfig {
        concurrency,
        poll_interval: poll,
        retry: RetryPolicy {
            max_attempts: 5,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            jitter: false,
        },
        ..WorkerConfig::default()
    }
}

/// What the recorder holds: a snapshot drains it, so the test takes one.
type Snapshot = Vec<(String, Vec<(String, String)>, DebugValue)>;

fn snapshot(snapshotter: &Snapshotter) -> Snapshot {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.key().name().to_owned(), labels, value)
        })
        .collect()
}

/// The counter `name` of `queue`, 0 when never recorded.
fn counter(snapshot: &Snapshot, name: &str, queue: &str) -> u64 {
    value(snapshot, name, queue)
        .map(|v| match v {
            DebugValue::Counter(n) => *n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .unwrap_or(0)
}

fn value<'s>(snapshot: &'s Snapshot, name: &str, queue: &str) -> Option<&'s DebugValue> {
    snapshot
        .iter()
        .find(|(metric, labels, _)| {
            metric == name && labels.iter().any(|(k, v)| k == QUEUE_LABEL && v == queue)
        })
        .map(|(_, _, value)| value)
}

fn samples(snapshot: &Snapshot, name: &str, queue: &str) -> usize {
    match value(snapshot, name, queue) {
        Some(DebugValue::Histogram(values)) => values.len(),
        None => 0,
        Some(other) => panic!("{name} is not a histogram: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_count_what_the_worker_did() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    let name = "metrics";
    let queue = MemoryBackend::new().with_queue(QueueName::new(name).unwrap());
    let lease = Lease::from_secs(10).unwrap();

    // A job whose worker died: claimed, its lease left to expire.
    let orphan = || NewJob::from_value(json!({ "kind": "ok" })).unique_key("orphan");
    queue.enqueue(orphan()).await.unwrap();
    queue.claim(ClaimRequest::new(1, lease)).await.unwrap();
    queue.advance_clock(Duration::from_secs(11));
    for kind in ["ok", "ok", "fail", "retry-once"] {
        queue
            .enqueue(NewJob::from_value(json!({ "kind": kind })))
            .await
            .unwrap();
    }
    queue
        .enqueue(NewJob::from_value(json!({ "kind": 5 })))
        .await
        .unwrap();
    assert!(queue.enqueue(orphan()).await.unwrap().duplicate);

    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let steps = || Steps {
        started: started.clone(),
        release: release.clone(),
    };
    let worker = Worker::new(queue.clone(), steps(), config(4, Duration::from_millis(10)))
        .unwrap()
        .start();
    let stats = worker
        .wait_for_timeout(Duration::from_secs(20), |s| {
            s.completed == 4 && s.failed == 2 && s.retried == 1
        })
        .await
        .expect("every job ends");
    worker.shutdown().await.unwrap();

    // A worker that loses its job while the handler runs: its write is refused by the fence.
    // It polls once an hour, so only the test takes the job over.
    let worker = Worker::new(queue.clone(), steps(), config(1, Duration::from_secs(3600)))
        .unwrap()
        .start();
    queue
        .enqueue(NewJob::from_value(json!({ "kind": "hang" })))
        .await
        .unwrap();
    started.notified().await;
    queue.advance_clock(WorkerConfig::default().lease.duration() + Duration::from_secs(1));
    let taken = queue.claim(ClaimRequest::new(1, lease)).await.unwrap();
    assert_eq!(taken.jobs.len(), 1, "the hanging job was not taken over");
    release.notify_one();
    worker
        .wait_for_timeout(Duration::from_secs(20), |s| s.stale == 1)
        .await
        .expect("the holder's write is fenced");
    worker.shutdown().await.unwrap();

    let snapshot = snapshot(&snapshotter);
    let count = |metric| counter(&snapshot, metric, name);
    assert_eq!(
        count(metrics::JOBS_ENQUEUED),
        7,
        "a duplicate key is no new job"
    );
    // Claims by workers only: 6 jobs, the retried one twice, the orphan's takeover.
    assert_eq!(count(metrics::JOBS_CLAIMED), 8);
    assert_eq!(count(metrics::JOBS_RECLAIMED), 1);
    assert_eq!(count(metrics::JOBS_COMPLETED), stats.completed);
    assert_eq!(count(metrics::JOBS_COMPLETED), 4);
    assert_eq!(count(metrics::JOBS_FAILED), 2);
    assert_eq!(count(metrics::JOBS_RETRIED), 1);
    assert_eq!(count(metrics::FINALIZE_STALE), 1);
    for quiet in [
        metrics::JOBS_DEAD,
        metrics::JOBS_CANCELLED,
        metrics::FINALIZE_ERRORS,
        metrics::FINALIZE_UNKNOWN,
        metrics::HOOK_FAILURES,
        metrics::CLAIM_FAILURES,
    ] {
        assert_eq!(count(quiet), 0, "{quiet}");
    }
    // Handlers ran 7 times (the malformed payload never reached one); fresh claims have a lag.
    assert_eq!(samples(&snapshot, metrics::JOB_RUN_DURATION, name), 7);
    assert_eq!(samples(&snapshot, metrics::JOB_START_LAG, name), 7);
    assert!(samples(&snapshot, metrics::CLAIM_DURATION, name) >= 2);
    assert!(samples(&snapshot, metrics::FINALIZE_DURATION, name) >= 1);
    match value(&snapshot, metrics::JOBS_IN_FLIGHT, name) {
        Some(DebugValue::Gauge(running)) => assert_eq!(running.into_inner(), 0.0),
        other => panic!("no in-flight gauge: {other:?}"),
    }
}
