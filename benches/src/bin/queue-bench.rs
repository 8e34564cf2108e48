//! `queue-bench`: end-to-end throughput and start latency of the worker runtime on PostgreSQL
//! or SQLite.
//!
//! ```text
//! cargo run --release -p benches --bin queue-bench -- --jobs 20000 --workers 8 [--runs 3]
//!     [--batch 500] [--latency-jobs 1000] [--rate 200] [--backend postgres|sqlite]
//!     [--driver sqlx|tokio-postgres]
//! ```
//! Per run, on a fresh scratch database (a PostgreSQL database, or a SQLite file in the
//! temporary directory): enqueue `--jobs` noop jobs in batches of 1000 (timed), then drain them
//! with one worker of concurrency `--workers` until SQL confirms every job completed (timed).
//! Then the latency phase: an idle worker woken by `LISTEN` (on SQLite, by the enqueue in the
//! same process), `--latency-jobs` enqueued one at a time at `--rate` per second; the time from
//! each enqueue call to its handler starting. Medians over the runs. The last line:
//! `bench: backend=B jobs=N workers=W enqueue_jps=E process_jps=P p50_start_ms=A p99_start_ms=B
//! duplicates=D`

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use queue_core::{Backend, Handler, JobContext, JobError, NewJob, Worker, WorkerConfig};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{PgQueue, PgQueueConfig, TokioPostgresQueue};
use serde_json::json;
use tokio::sync::Mutex;

/// Counts runs per job id (ids of one run are dense from `first`).
struct Counting {
    first: i64,
    runs: Arc<Vec<AtomicU32>>,
}

impl Handler for Counting {
    type Payload = serde_json::Value;
    async fn handle(&self, ctx: JobContext, _payload: serde_json::Value) -> Result<(), JobError> {
        if let Some(slot) = usize::try_from(ctx.id().0 - self.first)
            .ok()
            .and_then(|i| self.runs.get(i))
        {
            slot.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Records when each job started.
struct Stamping {
    started: Arc<Mutex<Vec<(i64, Instant)>>>,
}

impl Handler for Stamping {
    type Payload = serde_json::Value;
    async fn handle(&self, ctx: JobContext, _payload: serde_json::Value) -> Result<(), JobError> {
        let now = Instant::now();
        self.started.lock().await.push((ctx.id().0, now));
        Ok(())
    }
}

/// End-to-end throughput and start latency of the worker runtime on PostgreSQL.
#[derive(Debug, clap::Parser)]
#[command(name = "queue-bench")]
struct Options {
    /// Noop jobs per run.
    #[arg(long, default_value_t = 20_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000_000))]
    jobs: usize,
    /// The worker's concurrency.
    #[arg(long, default_value_t = 8, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100_000))]
    workers: usize,
    /// The most jobs one claim asks for.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch: u32,
    /// Runs (medians are reported).
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=100))]
    runs: usize,
    /// Jobs of the latency phase, enqueued one at a time.
    #[arg(long, default_value_t = 1000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    latency_jobs: usize,
    /// Enqueues per second in the latency phase.
    #[arg(long, default_value_t = 200.0)]
    rate: f64,
    /// The backend.
    #[arg(long, value_enum, default_value_t = BackendName::Postgres)]
    backend: BackendName,
    /// The PostgreSQL driver.
    #[arg(long, value_enum, default_value_t = DriverName::Sqlx)]
    driver: DriverName,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendName {
    Postgres,
    Sqlite,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DriverName {
    Sqlx,
    TokioPostgres,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

async fn completed<B: Backend>(queue: &B) -> u64 {
    queue.counts().await.expect("counts").completed
}

/// Enqueue, then drain; returns (enqueue jobs/s, process jobs/s, duplicates).
async fn throughput_run<B: Backend>(o: &Options, queue: B) -> (f64, f64, u64) {
    let start = Instant::now();
    let mut ids = Vec::with_capacity(o.jobs);
    for chunk in (0..o.jobs).collect::<Vec<_>>().chunks(1000) {
        let jobs = chunk
            .iter()
            .map(|n| NewJob::from_value(json!({ "n": n })))
            .collect();
        ids.extend(
            queue
                .enqueue_many(jobs)
                .await
                .expect("enqueue")
                .into_iter()
                .map(|e| e.id.0),
        );
    }
    let enqueue_jps = o.jobs as f64 / start.elapsed().as_secs_f64();
    let first = *ids.iter().min().expect("jobs");
    let last = *ids.iter().max().expect("jobs");
    let runs: Arc<Vec<AtomicU32>> = Arc::new((first..=last).map(|_| AtomicU32::new(0)).collect());

    let config = WorkerConfig {
        concurrency: o.workers,
        prefetch: o.batch as usize,
        max_batch: o.batch,
        poll_interval: Duration::from_millis(50),
        ..WorkerConfig::default()
    };
    let handler = Counting {
        first,
        runs: runs.clone(),
    };
    let start = Instant::now();
    let worker = Worker::new(queue.clone(), handler, config)
        .expect("config")
        .start();
    worker.wait_for(|s| s.completed >= o.jobs as u64).await;
    // The worker's count is what it wrote; the database must agree.
    while completed(&queue).await < o.jobs as u64 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let process_jps = o.jobs as f64 / start.elapsed().as_secs_f64();
    worker.shutdown().await.expect("shutdown");
    let invocations: u64 = runs
        .iter()
        .map(|r| u64::from(r.load(Ordering::Relaxed)))
        .sum();
    (
        enqueue_jps,
        process_jps,
        invocations.saturating_sub(o.jobs as u64),
    )
}

/// Start latency with NOTIFY: returns (p50 ms, p99 ms).
async fn latency_run<B: Backend>(o: &Options, queue: B) -> (f64, f64) {
    let started = Arc::new(Mutex::new(Vec::with_capacity(o.latency_jobs)));
    let config = WorkerConfig {
        concurrency: o.workers,
        // The poll is the fallback only: a job starting within the bench came through NOTIFY.
        poll_interval: Duration::from_secs(5),
        ..WorkerConfig::default()
    };
    let worker = Worker::new(
        queue.clone(),
        Stamping {
            started: started.clone(),
        },
        config,
    )
    .expect("config")
    .start();
    // Let the worker go idle and the listener connect.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut enqueued = Vec::with_capacity(o.latency_jobs);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate));
    for n in 0..o.latency_jobs {
        tick.tick().await;
        let at = Instant::now();
        let id = queue
            .enqueue(NewJob::from_value(json!({ "n": n })))
            .await
            .expect("enqueue")
            .id
            .0;
        enqueued.push((id, at));
    }
    worker
        .wait_for(|s| s.completed >= o.latency_jobs as u64)
        .await;
    worker.shutdown().await.expect("shutdown");
    let started: std::collections::HashMap<i64, Instant> =
        started.lock().await.iter().copied().collect();
    let mut waits: Vec<f64> = enqueued
        .iter()
        .map(|(id, at)| started[id].saturating_duration_since(*at).as_secs_f64() * 1000.0)
        .collect();
    waits.sort_by(f64::total_cmp);
    (percentile(&waits, 50.0), percentile(&waits, 99.0))
}

/// A handle on `db`'s standard table through the driver the options name.
async fn tp_queue(db: &ScratchDb, listen: bool) -> TokioPostgresQueue {
    let config = PgQueueConfig {
        listen,
        ..PgQueueConfig::default()
    };
    TokioPostgresQueue::connect(
        db.tokio_postgres_pool(12),
        config,
        db.tokio_postgres_config(),
    )
    .await
    .expect("schema")
}

/// One run: throughput on a fresh database, then latency on another.
async fn run_once(o: &Options) -> ((f64, f64, u64), (f64, f64)) {
    if o.backend == BackendName::Sqlite {
        let file = benches::ScratchSqlite::new("throughput").await;
        let throughput = throughput_run(o, file.queue.clone()).await;
        drop(file);
        let file = benches::ScratchSqlite::new("latency").await;
        let latency = latency_run(o, file.queue.clone()).await;
        return (throughput, latency);
    }
    let db = benches::scratch_db().await;
    let throughput = match o.driver {
        DriverName::Sqlx => throughput_run(o, benches::queue(&db.pool).await).await,
        DriverName::TokioPostgres => throughput_run(o, tp_queue(&db, false).await).await,
    };
    db.drop_db().await;
    let db = benches::scratch_db().await;
    let latency = match o.driver {
        DriverName::Sqlx => {
            let queue = PgQueue::connect(db.pool.clone(), PgQueueConfig::default())
                .await
                .expect("schema");
            latency_run(o, queue).await
        }
        DriverName::TokioPostgres => latency_run(o, tp_queue(&db, true).await).await,
    };
    db.drop_db().await;
    (throughput, latency)
}

#[tokio::main]
async fn main() {
    let o = <Options as clap::Parser>::parse();
    if !(o.rate > 0.0 && o.rate <= 100_000.0) {
        eprintln!("queue-bench: --rate must be above 0 and at most 100000");
        std::process::exit(2);
    }
    let (mut enq, mut proc, mut p50s, mut p99s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut duplicates = 0;
    for run in 1..=o.runs.max(1) {
        let ((e, p, d), (p50, p99)) = run_once(&o).await;
        println!(
            "run {run}: enqueue_jps={e:.0} process_jps={p:.0} p50_start_ms={p50:.2} p99_start_ms={p99:.2} duplicates={d}"
        );
        enq.push(e);
        proc.push(p);
        p50s.push(p50);
        p99s.push(p99);
        duplicates += d;
    }
    println!(
        "bench: backend={} jobs={} workers={} enqueue_jps={:.0} process_jps={:.0} p50_start_ms={:.2} p99_start_ms={:.2} duplicates={}",
        match o.backend {
            BackendName::Postgres => "postgres",
            BackendName::Sqlite => "sqlite",
        },
        o.jobs,
        o.workers,
        median(enq),
        median(proc),
        median(p50s),
        median(p99s),
        duplicates
    );
}
