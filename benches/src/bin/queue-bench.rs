//! `queue-bench`: end-to-end throughput and start latency of the worker runtime on PostgreSQL
//! or SQLite.
//!
//! ```text
//! cargo run --release -p benches --bin queue-bench -- --jobs 20000 --workers 8 [--runs 3]
//!     [--batch 500] [--latency-jobs 1000] [--rate 200] [--backend postgres|sqlite]
//!     [--driver sqlx|tokio-postgres] [--fuse] [--delay-ms 100 [--long-jobs 20]
//!     [--long-ms 3000] [--lease-ms 1200]]
//! ```
//! Per run, on a fresh scratch database (a PostgreSQL database, or a SQLite file in the
//! temporary directory): enqueue `--jobs` noop jobs in batches of 1000 (timed), then drain them
//! with one worker of concurrency `--workers` until SQL confirms every job completed (timed).
//! A drain that cannot get there (a job ended failed, dead or cancelled, or the drain took over
//! `--drain-timeout-secs`, 600 by default) ends the bench with status 1 and the jobs' counts by
//! state, its scratch database dropped.
//! Then the latency phase: an idle worker woken by `LISTEN` (on SQLite, by the enqueue in the
//! same process), `--latency-jobs` enqueued one at a time at `--rate` per second; the time from
//! each enqueue call to its handler starting. Medians over the runs. The last line:
//! `bench: backend=B jobs=N workers=W enqueue_jps=E process_jps=P p50_start_ms=A p99_start_ms=B
//! duplicates=D cpu_us_per_job=C fused=F`, where `cpu_us_per_job` is the bench process's CPU
//! time (every thread's, `CLOCK_PROCESS_CPUTIME_ID`) during the drain per job, and `fused` whether the worker
//! carried its outcomes with its claims (`--fuse`).
//!
//! `--hooks` adds a finalize hook that writes a domain row and an outbox row per job in the
//! outcome's transaction (the exchange's shape); outcomes with hooks are written many to a
//! transaction, a savepoint per job, unless `--one-transaction-per-job`. The last line then
//! adds `hooks=true batched=B`.
//!
//! `--backlog N` loads N completed rows before the latency phase (PostgreSQL).
//!
//! `--drop-lease-index` drops `queue_jobs_lease_idx` before the throughput phase (the last line
//! adds `lease_index=false`; the latency phase's table keeps it).
//!
//! `--instances N` drains with N workers on the queue, each of concurrency `--workers` and
//! with claims of its own: the database sees N claimers racing, as from N worker processes,
//! but the workers share this process, its queue handle and its pool of 12 connections. The
//! last line then adds `instances=N`.
//!
//! The sqlx driver runs on a pool of 12 that does not ping a connection before handing it out,
//! as the tokio-postgres driver's deadpool pool does not by default; `--sqlx-ping-on-acquire`
//! restores sqlx's default (a round trip before each statement) and adds
//! `sqlx_ping_on_acquire=true` to the last line.
//!
//! `--delay-ms D` makes the jobs I/O-bound, as a partner call is: each handler awaits `D` ms,
//! except the first `--long-jobs`, which await `--long-ms` under a lease of `--lease-ms` and so
//! live on heartbeats. The last line then adds `delay_ms=D target_jps=T` (0.9 × concurrency /
//! delay), `rss_kib_per_in_flight=R` (the process's peak resident memory during the drain above
//! its resident memory before it, per slot of concurrency; the largest over the runs, as later
//! runs reuse the heap the first one grew) and `lost_leases=L` (handlers told
//! their lease was lost or untrusted, plus jobs the database shows taken over: 0 when no
//! heartbeat starved) and `lease_ms=L`. The lease moves the figure: every job that waited in the
//! prefetch buffer over a hundredth of it renews it before starting, one statement each, so the
//! default 1.2 s lease measures those renewals and `--lease-ms 90000` (the framework's default)
//! does not (docs/performance.md, "I/O-bound: the renewal before start is the cost").

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use queue_core::{
    Backend, BoxError, FinalizeEvent, FinalizeHook, Handler, Hooks, JobContext, JobError, Lease,
    NewJob, Worker, WorkerConfig,
};
use queue_postgres::testing::ScratchDb;
use queue_postgres::{Driver, PgQueue, PgQueueConfig, PostgresTx, TokioPostgresQueue};
use serde_json::json;
use tokio::sync::Mutex;

/// Counts runs per job id (ids of one run are dense from `first`); in the I/O-bound mode,
/// awaits its delay first.
#[derive(Clone)]
struct Counting {
    first: i64,
    runs: Arc<Vec<AtomicU32>>,
    io: Option<IoBound>,
}

/// The I/O-bound mode's handler settings.
#[derive(Clone)]
struct IoBound {
    delay: Duration,
    long_jobs: i64,
    long: Duration,
    lost: Arc<AtomicU64>,
}

impl Handler for Counting {
    type Payload = serde_json::Value;
    async fn handle(&self, ctx: JobContext, _payload: serde_json::Value) -> Result<(), JobError> {
        let index = ctx.id().0 - self.first;
        if let Some(slot) = usize::try_from(index).ok().and_then(|i| self.runs.get(i)) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
        let Some(io) = &self.io else {
            return Ok(());
        };
        let wait = if index < io.long_jobs {
            io.long
        } else {
            io.delay
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => Ok(()),
            _ = ctx.cancellation().cancelled() => {
                io.lost.fetch_add(1, Ordering::Relaxed);
                Err(JobError::retry("the lease was lost"))
            }
        }
    }

    fn runs_long(&self) -> bool {
        self.io.is_some()
    }
}

/// The hooks mode's tables: a domain row and an outbox row per finished job.
const HOOK_TABLES: &str =
    "CREATE TABLE bench_domain (job_id bigint PRIMARY KEY, status text NOT NULL);
     CREATE TABLE bench_outbox (id bigserial PRIMARY KEY, job_id bigint NOT NULL,
                                event text NOT NULL, at timestamptz NOT NULL DEFAULT now())";

/// Writes the job's domain row and stages its outbox row in the finalize transaction: the
/// shape of the exchange's stamp and outbox hooks. For a batch, one statement each.
struct DomainAndOutbox;

impl<D: Driver, P: Sync> FinalizeHook<PostgresTx<D>, P> for DomainAndOutbox {
    fn name(&self) -> &str {
        "domain_and_outbox"
    }

    async fn after_applied(
        &self,
        tx: &mut PostgresTx<D>,
        event: &FinalizeEvent<'_, P>,
    ) -> Result<(), BoxError> {
        let (id, kind) = (event.job.id.0, event.action.kind());
        tx.execute(
            "INSERT INTO bench_domain (job_id, status) VALUES ($1, $2)
             ON CONFLICT (job_id) DO UPDATE SET status = EXCLUDED.status",
            (id, kind),
        )
        .await?;
        tx.execute(
            "INSERT INTO bench_outbox (job_id, event) VALUES ($1, $2)",
            (id, kind),
        )
        .await?;
        Ok(())
    }

    async fn after_applied_batch(
        &self,
        tx: &mut PostgresTx<D>,
        events: &[FinalizeEvent<'_, P>],
    ) -> Result<(), BoxError>
    where
        PostgresTx<D>: Send,
        P: Sync,
    {
        let ids: Vec<i64> = events.iter().map(|e| e.job.id.0).collect();
        let kinds: Vec<&str> = events.iter().map(|e| e.action.kind()).collect();
        tx.execute(
            "INSERT INTO bench_domain (job_id, status)
             SELECT * FROM unnest($1::bigint[], $2::text[])
             ON CONFLICT (job_id) DO UPDATE SET status = EXCLUDED.status",
            (&ids, &kinds),
        )
        .await?;
        tx.execute(
            "INSERT INTO bench_outbox (job_id, event)
             SELECT * FROM unnest($1::bigint[], $2::text[])",
            (&ids, &kinds),
        )
        .await?;
        Ok(())
    }
}

/// The hooks of a PostgreSQL run: [`DomainAndOutbox`] with `--hooks`, none otherwise.
fn pg_hooks<D: Driver>(o: &Options) -> Hooks<PostgresTx<D>, serde_json::Value> {
    let mut hooks = Hooks::new();
    if o.hooks {
        hooks.push(DomainAndOutbox);
    }
    hooks
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
    /// Workers draining the queue in the throughput phase, each of concurrency `--workers`
    /// with claims of its own (their claims race for the jobs and, under limits, take turns on
    /// the queue's row, as several worker processes' would); they share this process, the
    /// queue handle and its pool.
    #[arg(long, default_value_t = 1, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    instances: usize,
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
    /// Completed rows loaded into the table before the latency phase (PostgreSQL): the start
    /// latency with a queue's history in the table.
    #[arg(long, default_value_t = 0)]
    backlog: u64,
    /// Run a hook per job that writes a domain row and an outbox row in the finalize
    /// transaction (PostgreSQL).
    #[arg(long)]
    hooks: bool,
    /// Write each outcome with hooks in a transaction of its own
    /// (`WorkerConfig::batch_finalize` off).
    #[arg(long)]
    one_transaction_per_job: bool,
    /// Carry the batched outcomes with the claims (`WorkerConfig::fuse_claims`).
    #[arg(long)]
    fuse: bool,
    /// I/O-bound jobs: each handler awaits this many milliseconds (0: noop jobs).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=600_000))]
    delay_ms: u64,
    /// In the I/O-bound mode, how many of the first jobs run long, on heartbeats.
    #[arg(long, default_value_t = 20)]
    long_jobs: u32,
    /// How long a long job runs, in milliseconds.
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    long_ms: u64,
    /// The lease in the I/O-bound mode, in milliseconds (a heartbeat every third of it).
    #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u64).range(300..=600_000))]
    lease_ms: u64,
    /// Limit the queue to this many jobs in flight (`QueueLimits::max_in_flight`) for the
    /// throughput phase.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    limit_in_flight: Option<u32>,
    /// Limit the queue's starts: STARTS/MILLISECONDS (`QueueLimits::rate`), such as 1000000/1000.
    #[arg(long, value_parser = parse_rate)]
    limit_rate: Option<queue_core::RateLimit>,
    /// Put the throughput phase's jobs in this many partitions (`NewJob::partition_key`), in
    /// turn (0: none).
    #[arg(long, default_value_t = 0)]
    partitions: u32,
    /// Limit each partition to this many jobs in flight (`QueueLimits::max_per_partition`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    limit_per_partition: Option<u32>,
    /// Limit each partition's starts: STARTS/MILLISECONDS (`QueueLimits::rate_per_partition`).
    #[arg(long, value_parser = parse_rate)]
    limit_rate_per_partition: Option<queue_core::RateLimit>,
    /// Switch the queue's room grants on or off (PostgreSQL, `PostgresQueue::set_room_grants`;
    /// `--room-grants` alone is on). Without it the queue's row starts with them on (the
    /// default of `PgQueueConfig::room_grants_for_new_queues`): with limits in flight or a
    /// rate (per queue or per partition), each worker's handle claims on room granted for
    /// several claims; off, it claims ahead of the queue's row lock.
    #[arg(long, num_args = 0..=1, default_missing_value = "on",
          value_parser = clap::builder::BoolishValueParser::new())]
    room_grants: Option<bool>,
    /// Analyze the table after the throughput phase's enqueue (PostgreSQL), as autovacuum would
    /// soon after a bulk load: this machine's server runs without autovacuum, and a claim of
    /// partitions taking turns is planned badly on statistics of an empty table.
    #[arg(long)]
    analyze: bool,
    /// Drop `queue_jobs_lease_idx` after the migrations (PostgreSQL), as an operator may once
    /// every process runs a release that does not require it (docs/operations.md).
    #[arg(long)]
    drop_lease_index: bool,
    /// The sqlx driver's pool pings each connection it hands out (sqlx's default,
    /// `PoolOptions::test_before_acquire`): a round trip before every statement. Off by
    /// default here, as deadpool-postgres's default recycling checks only that the
    /// connection is open.
    #[arg(long)]
    sqlx_ping_on_acquire: bool,
    /// Give up on a drain that has not completed every job after this many seconds: the bench
    /// then names what the jobs' states are and exits with status 1.
    #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    drain_timeout_secs: u64,
}

fn parse_rate(value: &str) -> Result<queue_core::RateLimit, String> {
    let (starts, ms) = value
        .split_once('/')
        .ok_or_else(|| "expected STARTS/MILLISECONDS".to_owned())?;
    let starts = starts.parse().map_err(|e| format!("{e}"))?;
    let ms = ms.parse().map_err(|e| format!("{e}"))?;
    queue_core::RateLimit::new(starts, Duration::from_millis(ms)).map_err(|e| e.to_string())
}

impl Options {
    fn limits(&self) -> queue_core::QueueLimits {
        queue_core::QueueLimits {
            max_in_flight: self.limit_in_flight,
            rate: self.limit_rate,
            max_per_partition: self.limit_per_partition,
            rate_per_partition: self.limit_rate_per_partition,
        }
    }

    /// The throughput phase's job number `n`, in its partition when there are partitions.
    fn job(&self, n: usize) -> NewJob {
        let job = NewJob::from_value(json!({ "n": n }));
        match self.partitions {
            0 => job,
            partitions => job.partition_key(format!("p{}", n % partitions as usize)),
        }
    }
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

/// Waits until the workers have completed `jobs` jobs and the database agrees. Fails, naming
/// the jobs' states, when a job ended otherwise (the noop handler never fails, but a job whose
/// lease was taken over too often ends `dead`) or when `deadline` passes first: without it, a
/// drain short of a job would wait forever.
async fn drain<B: Backend>(
    queue: &B,
    workers: &[queue_core::WorkerHandle],
    jobs: u64,
    deadline: Instant,
) -> Result<(), String> {
    let ended_otherwise = |s: &queue_core::WorkerStats| s.failed + s.dead + s.cancelled > 0;
    let waited = async {
        if let [worker] = workers {
            // One worker: woken by its counters, not a poll, so the figure has no poll's lag.
            worker
                .wait_for(|s| s.completed >= jobs || ended_otherwise(s))
                .await;
        }
        loop {
            let stats: Vec<_> = workers.iter().map(|w| w.stats()).collect();
            if stats.iter().any(ended_otherwise) {
                return false;
            }
            if stats.iter().map(|s| s.completed).sum::<u64>() >= jobs {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // The workers' count is what they wrote; the database must agree.
        while queue.counts().await.expect("counts").completed < jobs {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    };
    let why = match tokio::time::timeout_at(deadline.into(), waited).await {
        Ok(true) => return Ok(()),
        Ok(false) => "a job ended other than completed",
        Err(_) => "the drain timed out (--drain-timeout-secs)",
    };
    let c = queue.counts().await.expect("counts");
    Err(format!(
        "{why}: {} of {jobs} jobs completed; pending={} in_flight={} failed={} dead={} \
         cancelled={}",
        c.completed, c.pending, c.in_flight, c.failed, c.dead, c.cancelled
    ))
}

/// The process's CPU time so far, every thread's (`CLOCK_PROCESS_CPUTIME_ID`).
fn cpu_time() -> Duration {
    cpu_time::ProcessTime::now().as_duration()
}

/// A `kB` figure of `/proc/self/status` (`VmRSS`, `VmHWM`).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// What one drain measured.
struct Drained {
    enqueue_jps: f64,
    process_jps: f64,
    duplicates: u64,
    cpu_us_per_job: f64,
    rss_kib_per_in_flight: f64,
    lost_leases: u64,
}

/// Enqueue, then drain.
async fn throughput_run<B: queue_core::Admin>(
    o: &Options,
    queue: B,
    hooks: impl Fn() -> Hooks<B::Tx, serde_json::Value>,
    analyze: Option<&sqlx::PgPool>,
) -> Result<Drained, String> {
    if !o.limits().is_none() {
        queue.set_limits(o.limits()).await.expect("limits");
    }
    let start = Instant::now();
    let mut ids = Vec::with_capacity(o.jobs);
    for chunk in (0..o.jobs).collect::<Vec<_>>().chunks(1000) {
        let jobs = chunk.iter().map(|n| o.job(*n)).collect();
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
    if let Some(pool) = analyze.filter(|_| o.analyze) {
        sqlx::raw_sql("ANALYZE queue_jobs")
            .execute(pool)
            .await
            .expect("analyze");
    }
    let first = *ids.iter().min().expect("jobs");
    let last = *ids.iter().max().expect("jobs");
    let runs: Arc<Vec<AtomicU32>> = Arc::new((first..=last).map(|_| AtomicU32::new(0)).collect());

    let lost = Arc::new(AtomicU64::new(0));
    let io = (o.delay_ms > 0).then(|| IoBound {
        delay: Duration::from_millis(o.delay_ms),
        long_jobs: i64::from(o.long_jobs),
        long: Duration::from_millis(o.long_ms),
        lost: lost.clone(),
    });
    let mut config = WorkerConfig {
        concurrency: o.workers,
        prefetch: o.batch as usize,
        max_batch: o.batch,
        poll_interval: Duration::from_millis(50),
        fuse_claims: o.fuse,
        batch_finalize: !o.one_transaction_per_job,
        ..WorkerConfig::default()
    };
    if io.is_some() {
        config.lease = Lease::new(Duration::from_millis(o.lease_ms)).expect("lease");
    }
    let handler = Counting {
        first,
        runs: runs.clone(),
        io,
    };
    // The peak resident size from here on (`5` resets VmHWM to the current size).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let rss_before = status_kib("VmRSS");
    let cpu_before = cpu_time();
    let start = Instant::now();
    let workers: Vec<_> = (0..o.instances)
        .map(|_| {
            Worker::new(queue.clone(), handler.clone(), config.clone())
                .expect("config")
                .hooks(hooks())
                .start()
        })
        .collect();
    let deadline = start + Duration::from_secs(o.drain_timeout_secs);
    if let Err(waited) = drain(&queue, &workers, o.jobs as u64, deadline).await {
        for worker in workers {
            let _ = worker.shutdown().await;
        }
        return Err(waited);
    }
    let process_jps = o.jobs as f64 / start.elapsed().as_secs_f64();
    let cpu = cpu_time().saturating_sub(cpu_before);
    let peak = status_kib("VmHWM");
    let mut stale = 0;
    for worker in workers {
        stale += worker.shutdown().await.expect("shutdown").stats.stale;
    }
    let invocations: u64 = runs
        .iter()
        .map(|r| u64::from(r.load(Ordering::Relaxed)))
        .sum();
    Ok(Drained {
        enqueue_jps,
        process_jps,
        duplicates: invocations.saturating_sub(o.jobs as u64),
        cpu_us_per_job: cpu.as_secs_f64() * 1e6 / o.jobs as f64,
        rss_kib_per_in_flight: peak.saturating_sub(rss_before) as f64
            / (o.workers * o.instances) as f64,
        lost_leases: lost.load(Ordering::Relaxed) + stale,
    })
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

/// The sqlx driver's pool on `db`: as large as the tokio-postgres one, pinging each
/// connection it hands out only when the options ask.
async fn sqlx_pool(o: &Options, db: &ScratchDb) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .test_before_acquire(o.sqlx_ping_on_acquire)
        .connect_with((*db.pool.connect_options()).clone())
        .await
        .expect("the sqlx pool")
}

/// One run: throughput on a fresh database, then latency on another.
async fn run_once(o: &Options) -> Result<(Drained, (f64, f64)), String> {
    if o.backend == BackendName::Sqlite {
        let file = benches::ScratchSqlite::new("throughput").await;
        let throughput = throughput_run(o, file.queue.clone(), Hooks::new, None).await?;
        drop(file);
        let file = benches::ScratchSqlite::new("latency").await;
        let latency = latency_run(o, file.queue.clone()).await;
        return Ok((throughput, latency));
    }
    let db = benches::scratch_db().await;
    if o.drop_lease_index {
        queue_postgres::testing::drop_lease_index(&db.pool, &queue_postgres::TableName::default())
            .await;
    }
    if o.hooks {
        sqlx::raw_sql(HOOK_TABLES)
            .execute(&db.pool)
            .await
            .expect("the hook tables");
    }
    let throughput = match o.driver {
        DriverName::Sqlx => {
            let queue = benches::queue(&sqlx_pool(o, &db).await).await;
            if let Some(on) = o.room_grants {
                queue.set_room_grants(on).await.expect("room grants");
            }
            throughput_run(o, queue, || pg_hooks(o), Some(&db.pool)).await
        }
        DriverName::TokioPostgres => {
            let queue = tp_queue(&db, false).await;
            if let Some(on) = o.room_grants {
                queue.set_room_grants(on).await.expect("room grants");
            }
            throughput_run(o, queue, || pg_hooks(o), Some(&db.pool)).await
        }
    };
    // A drain that failed leaves nothing behind either.
    db.drop_db().await;
    let throughput = throughput?;
    let db = benches::scratch_db().await;
    if o.backlog > 0 {
        // The table exists once a queue handle has checked it.
        let _ = benches::queue(&db.pool).await;
        benches::load(&db.pool, 0, o.backlog).await;
    }
    let latency = match o.driver {
        DriverName::Sqlx => {
            let queue = PgQueue::connect(sqlx_pool(o, &db).await, PgQueueConfig::default())
                .await
                .expect("schema");
            latency_run(o, queue).await
        }
        DriverName::TokioPostgres => latency_run(o, tp_queue(&db, true).await).await,
    };
    db.drop_db().await;
    Ok((throughput, latency))
}

#[tokio::main]
async fn main() {
    let o = <Options as clap::Parser>::parse();
    if !(o.rate > 0.0 && o.rate <= 100_000.0) {
        eprintln!("queue-bench: --rate must be above 0 and at most 100000");
        std::process::exit(2);
    }
    let (mut enq, mut proc, mut p50s, mut p99s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut cpus, mut rss) = (Vec::new(), Vec::new());
    let (mut duplicates, mut lost) = (0, 0);
    for run in 1..=o.runs.max(1) {
        let (d, (p50, p99)) = run_once(&o).await.unwrap_or_else(|failed| {
            eprintln!("queue-bench: run {run}: {failed}");
            std::process::exit(1);
        });
        println!(
            "run {run}: enqueue_jps={:.0} process_jps={:.0} p50_start_ms={p50:.2} p99_start_ms={p99:.2} duplicates={} cpu_us_per_job={:.2} rss_kib_per_in_flight={:.1} lost_leases={}",
            d.enqueue_jps,
            d.process_jps,
            d.duplicates,
            d.cpu_us_per_job,
            d.rss_kib_per_in_flight,
            d.lost_leases
        );
        enq.push(d.enqueue_jps);
        proc.push(d.process_jps);
        p50s.push(p50);
        p99s.push(p99);
        cpus.push(d.cpu_us_per_job);
        rss.push(d.rss_kib_per_in_flight);
        duplicates += d.duplicates;
        lost += d.lost_leases;
    }
    let mut io = if o.delay_ms > 0 {
        format!(
            " delay_ms={} target_jps={:.0} rss_kib_per_in_flight={:.1} lost_leases={lost} \
             lease_ms={}",
            o.delay_ms,
            0.9 * (o.workers * o.instances) as f64 * 1000.0 / o.delay_ms as f64,
            rss.iter().copied().fold(0.0, f64::max),
            o.lease_ms
        )
    } else {
        String::new()
    };
    if o.hooks {
        io.push_str(&format!(
            " hooks=true batched={}",
            !o.one_transaction_per_job
        ));
    }
    if o.sqlx_ping_on_acquire && o.driver == DriverName::Sqlx {
        io.push_str(" sqlx_ping_on_acquire=true");
    }
    if !o.limits().is_none() {
        io.push_str(&format!(" limits=\"{}\"", o.limits()));
    }
    if o.instances > 1 {
        io.push_str(&format!(" instances={}", o.instances));
    }
    if o.drop_lease_index && o.backend == BackendName::Postgres {
        io.push_str(" lease_index=false");
    }
    println!(
        "bench: backend={} jobs={} workers={} enqueue_jps={:.0} process_jps={:.0} p50_start_ms={:.2} p99_start_ms={:.2} duplicates={} cpu_us_per_job={:.2} fused={}{io}",
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
        duplicates,
        median(cpus),
        o.fuse && o.backend == BackendName::Postgres,
    );
}
