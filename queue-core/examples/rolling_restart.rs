//! A rolling restart on the in-memory backend: several workers drain a backlog while each is
//! replaced in turn with a graceful shutdown. Every job runs to completion once; claims held by a
//! stopping worker are released, not stranded for a lease.
//!
//! `cargo run -p queue-core --example rolling_restart -- 5000`

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use queue_core::{
    Backend, Handler, JobContext, JobError, MemoryBackend, NewJob, Worker, WorkerConfig,
    WorkerHandle,
};
use serde_json::{Value, json};

/// Counts runs per job and takes a little time, like a real send.
#[derive(Clone)]
struct Send {
    runs: Arc<Mutex<HashMap<i64, u32>>>,
}

impl Handler for Send {
    type Payload = Value;
    async fn handle(&self, ctx: JobContext, _payload: Value) -> Result<(), JobError> {
        tokio::time::sleep(Duration::from_millis(2)).await;
        *self.runs.lock().unwrap().entry(ctx.id().0).or_insert(0) += 1;
        Ok(())
    }
}

fn start(queue: &MemoryBackend, handler: &Send) -> WorkerHandle {
    let config = WorkerConfig {
        concurrency: 16,
        prefetch: 16,
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::default()
    };
    Worker::new(queue.clone(), handler.clone(), config)
        .expect("valid worker config")
        .start()
}

#[tokio::main]
async fn main() -> queue_core::Result<()> {
    let jobs: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(3000);
    let started = Instant::now();
    let queue = MemoryBackend::new();
    queue
        .enqueue_many(
            (0..jobs)
                .map(|n| NewJob::from_value(json!({ "n": n })))
                .collect(),
        )
        .await?;
    let handler = Send {
        runs: Arc::new(Mutex::new(HashMap::new())),
    };
    let mut workers: Vec<WorkerHandle> = (0..3).map(|_| start(&queue, &handler)).collect();
    println!("backend=memory jobs={jobs} workers=3: draining, then restarting each worker in turn");

    let mut released = 0;
    for round in 0..3 {
        let target = (jobs as u64 * (round + 1)) / 4;
        while queue.counts().await?.completed < target {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let old = workers.remove(0);
        let report = old.shutdown().await?;
        released += report.released_unstarted;
        println!(
            "restart {}: stopped a worker (released {} unstarted, {} finished in time), started its replacement",
            round + 1,
            report.released_unstarted,
            report.finished_in_time
        );
        workers.push(start(&queue, &handler));
    }
    while queue.counts().await?.live() > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut stale = 0;
    for worker in workers {
        stale += worker.stats().stale;
        worker.shutdown().await?;
    }
    let counts = queue.counts().await?;
    let runs = handler.runs.lock().unwrap();
    let duplicate_runs: u32 = runs.values().map(|n| n - 1).sum();
    println!(
        "summary: jobs={jobs} completed={} duplicate_runs={duplicate_runs} released={released} stale_fenced={stale} backend=memory elapsed_ms={}",
        counts.completed,
        started.elapsed().as_millis()
    );
    Ok(())
}
