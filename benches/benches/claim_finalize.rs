//! Claim and finalize against the local PostgreSQL.
//!
//! `cargo bench -p benches --bench claim_finalize`
//!
//! * `claim/batch/B`: one claim of B jobs out of a 100k backlog (the finalize of the claimed
//!   jobs runs outside the timed section).
//! * `claim_backlog/form/shape`: a claim of 1 at 1k, 100k, 1M and 10M due rows and at 1k due
//!   among 1M finished rows, for our statement; at 1k and 100k also for the pre-lease single-OR
//!   form (kept here only as the baseline it replaced). A shape's rows are loaded only when a
//!   benchmark of it runs (10M rows take about two minutes to load).
//! * `finalize/one_by_one` vs `finalize/batched`: completing 100 claimed jobs.
//! * `enqueue/one` vs `enqueue/many/{1000,10000,100000}` (no unique keys; also through the
//!   tokio-postgres driver, `many_tokio_postgres`) and
//!   `enqueue/keyed/{1000,10000}` (a new unique key per job).
//! * `claim_limits/{none,max_in_flight_100000,max_per_partition_8,max_per_partition_1000,
//!   rate_per_partition_100000_per_s,rate_per_partition_1000_per_s}`:
//!   one claim of 500 out of a
//!   100k backlog in 1 000 partitions with 500 jobs held in flight, without limits and under
//!   each limit that never binds (the cost of counting, the claim's statement alone; the
//!   last rate leaves each partition far under it but not the queue's sum, so claims count in
//!   the tally per slot).
//! * `memory/enqueue_claim_complete_100`: the in-memory backend's whole cycle.
//! * `drivers/{claim_100,finalize_100}/{sqlx,tokio-postgres}`: the two PostgreSQL drivers side by
//!   side on one database.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use queue_core::{Backend, ClaimRequest, Finalize, Lease};
use sqlx::AssertSqlSafe;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn req(batch: u32) -> ClaimRequest {
    ClaimRequest::new(batch, Lease::DEFAULT)
}

/// The pre-lease send queue's claim (one OR predicate, one ORDER BY over both sets): the baseline.
const SEED_FORM_CLAIM: &str = r#"
UPDATE queue_jobs SET status = 'in_flight', attempts = attempts + 1, claimed_at = now(),
       claim_generation = claim_generation + 1
WHERE id IN (
    SELECT id FROM queue_jobs
    WHERE (status = 'pending' AND next_attempt_at <= now())
       OR (status = 'in_flight' AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $2)))
    ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING id, claim_generation
"#;

fn claim_batches(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(benches::scratch_db());
    let queue = rt.block_on(benches::queue(&db.pool));
    rt.block_on(benches::load(&db.pool, 100_000, 0));
    let mut group = c.benchmark_group("claim/batch");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(5));
    for batch in [1u32, 10, 100, 500] {
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(BenchmarkId::from_parameter(batch), &batch, |b, &batch| {
            b.to_async(&rt).iter_custom(|iters| {
                let queue = queue.clone();
                async move { claim_and_put_back(&queue, batch, iters, Timed::Claim).await }
            })
        });
    }
    group.finish();
    rt.block_on(db.drop_db());
}

/// Which half of a claim-and-put-back round a benchmark times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Timed {
    /// The claim.
    Claim,
    /// The batched fenced write that puts the jobs back.
    Release,
}

/// `iters` rounds of: claim `batch` jobs, then release them all in one batched fenced write, so
/// the backlog keeps its depth between samples. Returns the time spent in the timed half.
async fn claim_and_put_back<B: Backend>(
    queue: &B,
    batch: u32,
    iters: u64,
    timed: Timed,
) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let jobs = queue.claim(req(batch)).await.unwrap().jobs;
        if timed == Timed::Claim {
            spent += start.elapsed();
        }
        assert!(!jobs.is_empty(), "the backlog ran dry");
        let back: Vec<_> = jobs
            .iter()
            .map(|j| (j.claim(), Finalize::Release))
            .collect();
        let start = Instant::now();
        queue.finalize_many(&back).await.unwrap();
        if timed == Timed::Release {
            spent += start.elapsed();
        }
    }
    spent
}

/// The claim's cost under limits that never bind: 100k due rows in 1 000 partitions, 500 jobs
/// in flight (held by a claim that never finalizes, so the limits have rows to count); then
/// claims of 500, put back after each, under each limit in turn, each mode on a table vacuumed
/// and analyzed with those 500 in flight.
fn claim_limits(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(benches::scratch_db());
    // The statement's cost, not the disk's: a commit does not wait for its WAL flush here (the
    // flush is the same under every limit and is most of this machine's noise).
    let options = (*db.pool.connect_options())
        .clone()
        .options([("synchronous_commit", "off")]);
    let pool = rt
        .block_on(sqlx::postgres::PgPoolOptions::new().connect_with(options))
        .expect("a pool without synchronous commit");
    rt.block_on(async {
        sqlx::query(
            "INSERT INTO queue_jobs (payload, partition_key, next_attempt_at)
             SELECT jsonb_build_object('n', g), 'p' || (g % 1000), now() - make_interval(secs => g)
             FROM generate_series(1, 100000) g",
        )
        .execute(&pool)
        .await
        .expect("load partitioned rows");
        let holder = benches::queue(&pool).await;
        let held = holder.claim(req(500)).await.expect("hold 500").jobs;
        assert_eq!(held.len(), 500);
    });
    let mut group = c.benchmark_group("claim_limits");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(6))
        .throughput(Throughput::Elements(500));
    let modes = [
        ("none", queue_core::QueueLimits::default()),
        (
            "max_in_flight_100000",
            queue_core::QueueLimits {
                max_in_flight: Some(100_000),
                ..Default::default()
            },
        ),
        (
            "max_per_partition_8",
            queue_core::QueueLimits {
                max_per_partition: Some(8),
                ..Default::default()
            },
        ),
        (
            // Above the queue's jobs in flight and picks together: no key is counted.
            "max_per_partition_1000",
            queue_core::QueueLimits {
                max_per_partition: Some(1_000),
                ..Default::default()
            },
        ),
        (
            // Far under: the queue's tally leaves room for every claim, no partition is counted.
            "rate_per_partition_100000_per_s",
            queue_core::QueueLimits {
                rate_per_partition: Some(
                    queue_core::RateLimit::new(100_000, Duration::from_secs(1)).unwrap(),
                ),
                ..Default::default()
            },
        ),
        (
            // Each partition far under its rate, the queue's sum over it (about 80 claims of
            // 500 partitions a second): claims count in the tally per slot.
            "rate_per_partition_1000_per_s",
            queue_core::QueueLimits {
                rate_per_partition: Some(
                    queue_core::RateLimit::new(1_000, Duration::from_secs(1)).unwrap(),
                ),
                ..Default::default()
            },
        ),
    ];
    for (label, limits) in modes {
        // A handle of its own per mode, so that no cached view of the limits carries over; and
        // the versions the last mode's claims left behind vacuumed, so that none pays for them.
        let queue = rt.block_on(async {
            sqlx::raw_sql("VACUUM ANALYZE queue_jobs")
                .execute(&pool)
                .await
                .expect("vacuum");
            let queue = benches::queue(&pool).await;
            queue_core::Admin::set_limits(&queue, limits)
                .await
                .expect("limits");
            // The claim statements themselves, not grants (a new queue's row starts with them
            // on): the claims ahead of the lock and under it.
            queue.set_room_grants(false).await.expect("grants off");
            queue
        });
        group.bench_function(label, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let queue = queue.clone();
                async move { claim_and_put_back(&queue, 500, iters, Timed::Claim).await }
            })
        });
    }
    group.finish();
    rt.block_on(pool.close());
    rt.block_on(db.drop_db());
}

fn claim_against_backlog(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("claim_backlog");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    // (label, due rows, finished rows, also time the single-OR form)
    let shapes: [(&str, u64, u64, bool); 5] = [
        ("due_1k", 1_000, 0, true),
        ("due_100k", 100_000, 0, true),
        ("due_1m", 1_000_000, 0, false),
        ("due_10m", 10_000_000, 0, false),
        ("due_1k_finished_1m", 1_000, 1_000_000, false),
    ];
    for (label, due, finished, single_or_too) in shapes {
        // Loaded by the first benchmark of the shape that the filter lets run.
        let loaded = std::cell::OnceCell::new();
        let setup = || {
            loaded.get_or_init(|| {
                let db = rt.block_on(benches::scratch_db());
                let queue = rt.block_on(benches::queue(&db.pool));
                rt.block_on(benches::load(&db.pool, due, finished));
                (db, queue)
            })
        };
        group.bench_function(BenchmarkId::new("ours", label), |b| {
            let queue = setup().1.clone();
            b.to_async(&rt).iter_custom(|iters| {
                let queue = queue.clone();
                async move { claim_and_put_back(&queue, 1, iters, Timed::Claim).await }
            })
        });
        if single_or_too {
            group.bench_function(BenchmarkId::new("single_or_form", label), |b| {
                let pool = setup().0.pool.clone();
                b.to_async(&rt).iter_custom(|iters| {
                    let pool = pool.clone();
                    async move {
                        let mut spent = Duration::ZERO;
                        for _ in 0..iters {
                            let start = Instant::now();
                            let rows = sqlx::query(AssertSqlSafe(SEED_FORM_CLAIM))
                                .bind(1_i64)
                                .bind(90.0_f64)
                                .fetch_all(&pool)
                                .await
                                .unwrap();
                            spent += start.elapsed();
                            assert_eq!(rows.len(), 1);
                            sqlx::query("UPDATE queue_jobs SET status = 'pending', attempts = attempts - 1 WHERE status = 'in_flight'")
                                .execute(&pool)
                                .await
                                .unwrap();
                        }
                        spent
                    }
                })
            });
        }
        if let Some((db, _)) = loaded.into_inner() {
            rt.block_on(db.drop_db());
        }
    }
    group.finish();
}

/// The two drivers side by side on the same database: claim of 100, batched finalize of 100.
fn drivers(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(benches::scratch_db());
    rt.block_on(benches::load(&db.pool, 50_000, 0));
    let sqlx_queue = rt.block_on(benches::queue(&db.pool));
    let config = queue_postgres::PgQueueConfig {
        listen: false,
        ..queue_postgres::PgQueueConfig::default()
    };
    let tp_queue = rt
        .block_on(queue_postgres::TokioPostgresQueue::connect(
            db.tokio_postgres_pool(4),
            config,
            db.tokio_postgres_config(),
        ))
        .unwrap();
    let mut group = c.benchmark_group("drivers");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(100));
    for (op, timed) in [
        ("claim_100", Timed::Claim),
        ("finalize_100", Timed::Release),
    ] {
        group.bench_function(BenchmarkId::new(op, "sqlx"), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let queue = sqlx_queue.clone();
                async move { claim_and_put_back(&queue, 100, iters, timed).await }
            })
        });
        group.bench_function(BenchmarkId::new(op, "tokio-postgres"), |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let queue = tp_queue.clone();
                async move { claim_and_put_back(&queue, 100, iters, timed).await }
            })
        });
    }
    group.finish();
    drop(tp_queue);
    rt.block_on(db.drop_db());
}

fn enqueue(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(benches::scratch_db());
    let queue = rt.block_on(benches::queue(&db.pool));
    let tp = rt
        .block_on(queue_postgres::TokioPostgresQueue::connect(
            db.tokio_postgres_pool(4),
            queue_postgres::PgQueueConfig {
                listen: false,
                ..queue_postgres::PgQueueConfig::default()
            },
            db.tokio_postgres_config(),
        ))
        .unwrap();
    let mut group = c.benchmark_group("enqueue");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(1));
    group.bench_function("one", |b| {
        b.to_async(&rt).iter(|| {
            let queue = queue.clone();
            async move {
                queue
                    .enqueue(queue_core::NewJob::from_value(
                        serde_json::json!({ "n": 1 }),
                    ))
                    .await
                    .unwrap()
            }
        })
    });
    // Jobs without unique keys take enqueue_plain.sql; with keys (each new), enqueue.sql.
    let fresh = std::sync::atomic::AtomicU64::new(0);
    for (size, keyed) in [
        (1_000, false),
        (10_000, false),
        (100_000, false),
        (1_000, true),
        (10_000, true),
    ] {
        group.throughput(Throughput::Elements(size));
        group.sample_size(10);
        let name = if keyed { "keyed" } else { "many" };
        if !keyed {
            let fresh = &fresh;
            group.bench_function(BenchmarkId::new("many_tokio_postgres", size), |b| {
                b.to_async(&rt).iter(|| {
                    let queue = tp.clone();
                    let first = fresh.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                    async move {
                        let jobs = (first..first + size)
                            .map(|n| queue_core::NewJob::from_value(serde_json::json!({ "n": n })))
                            .collect();
                        queue.enqueue_many(jobs).await.unwrap()
                    }
                })
            });
        }
        group.bench_function(BenchmarkId::new(name, size), |b| {
            b.to_async(&rt).iter(|| {
                let queue = queue.clone();
                let first = fresh.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                async move {
                    let jobs = (first..first + size)
                        .map(|n| {
                            let job = queue_core::NewJob::from_value(serde_json::json!({ "n": n }));
                            match keyed {
                                true => job.unique_key(format!("k{n}")),
                                false => job,
                            }
                        })
                        .collect();
                    queue.enqueue_many(jobs).await.unwrap()
                }
            })
        });
    }
    group.finish();
    rt.block_on(db.drop_db());
}

fn memory_backend(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("memory");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(3));
    group.throughput(Throughput::Elements(100));
    group.bench_function("enqueue_claim_complete_100", |b| {
        b.to_async(&rt).iter(|| async {
            let queue = queue_core::MemoryBackend::new();
            let jobs = (0..100)
                .map(|n| queue_core::NewJob::from_value(serde_json::json!({ "n": n })))
                .collect();
            queue.enqueue_many(jobs).await.unwrap();
            let claimed = queue.claim(req(100)).await.unwrap().jobs;
            let done: Vec<_> = claimed
                .iter()
                .map(|j| (j.claim(), Finalize::Complete))
                .collect();
            queue.finalize_many(&done).await.unwrap()
        })
    });
    group.finish();
}

fn finalize(c: &mut Criterion) {
    let rt = runtime();
    let db = rt.block_on(benches::scratch_db());
    let queue = rt.block_on(benches::queue(&db.pool));
    rt.block_on(benches::load(&db.pool, 50_000, 0));
    let mut group = c.benchmark_group("finalize");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(100));
    for batched in [false, true] {
        let name = if batched { "batched" } else { "one_by_one" };
        group.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let queue = queue.clone();
                async move {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let jobs = queue.claim(req(100)).await.unwrap().jobs;
                        // Release (not complete) keeps the backlog from draining between samples.
                        let items: Vec<_> = jobs
                            .iter()
                            .map(|j| (j.claim(), Finalize::Release))
                            .collect();
                        let start = Instant::now();
                        if batched {
                            queue.finalize_many(&items).await.unwrap();
                        } else {
                            for (claim, action) in &items {
                                let _ = queue.finalize(*claim, action).await.unwrap();
                            }
                        }
                        spent += start.elapsed();
                    }
                    spent
                }
            })
        });
    }
    group.finish();
    rt.block_on(db.drop_db());
}

/// `Backend::stats` on a million rows: the queue's history, a due backlog, an hour of
/// completions (the last reads every row finished in the hour).
fn stats(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("stats");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    // (label, due rows, finished rows, how long ago they finished)
    let shapes: [(&str, u64, u64, &str); 3] = [
        ("due_1k_finished_1m_a_day_ago", 1_000, 1_000_000, "1 day"),
        ("due_1m", 1_000_000, 0, "1 day"),
        (
            "due_1k_finished_1m_this_hour",
            1_000,
            1_000_000,
            "10 minutes",
        ),
    ];
    for (label, due, finished, ago) in shapes {
        let db = rt.block_on(benches::scratch_db());
        let queue = rt.block_on(benches::queue(&db.pool));
        rt.block_on(benches::load(&db.pool, due, 0));
        rt.block_on(async {
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO queue_jobs (status, payload, finished_at, next_attempt_at)
                 SELECT 'completed', '{{}}', now() - interval '{ago}', now() - interval '{ago}'
                 FROM generate_series(1, $1);
                 "
            )))
            .bind(finished as i64)
            .execute(&db.pool)
            .await
            .unwrap();
            sqlx::raw_sql("VACUUM ANALYZE queue_jobs")
                .execute(&db.pool)
                .await
                .unwrap();
        });
        group.bench_function(label, |b| {
            b.to_async(&rt).iter(|| {
                let queue = queue.clone();
                async move { queue.stats(Duration::from_secs(60)).await.unwrap() }
            })
        });
        rt.block_on(db.drop_db());
    }
    group.finish();
}

criterion_group!(
    benches,
    stats,
    claim_batches,
    claim_limits,
    claim_against_backlog,
    finalize,
    enqueue,
    memory_backend,
    drivers
);
criterion_main!(benches);
