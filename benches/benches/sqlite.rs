//! Claim and batched finalize on SQLite, beside PostgreSQL in the same run (the baseline).
//!
//! `cargo bench -p benches --bench sqlite`
//!
//! * `backend_claim_10/{sqlite,postgres}/{due_1k,due_100k}`: one claim of 10 jobs out of a
//!   backlog of 1k or 100k due rows (the jobs are put back outside the timed section).
//! * `backend_finalize_100/{sqlite,postgres}/{due_1k,due_100k}`: one batched fenced write of
//!   100 outcomes (releases, so the backlog keeps its depth).
//!
//! SQLite runs with the backend's defaults: WAL, `synchronous = FULL` (a commit is on disk when
//! it returns), on the machine's temporary directory.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use queue_core::{Backend, ClaimRequest, Finalize, Lease};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// `iters` rounds of a claim of `batch` and a batched release of what it took; returns the
/// time of the claims (`time_claim`) or of the releases.
async fn claim_and_put_back<B: Backend>(
    queue: &B,
    batch: u32,
    iters: u64,
    time_claim: bool,
) -> Duration {
    let mut spent = Duration::ZERO;
    for _ in 0..iters {
        let start = Instant::now();
        let jobs = queue
            .claim(ClaimRequest::new(batch, Lease::DEFAULT))
            .await
            .unwrap()
            .jobs;
        if time_claim {
            spent += start.elapsed();
        }
        assert_eq!(jobs.len(), batch as usize, "the backlog ran dry");
        let back: Vec<_> = jobs
            .iter()
            .map(|j| (j.claim(), Finalize::Release))
            .collect();
        let start = Instant::now();
        queue.finalize_many(&back).await.unwrap();
        if !time_claim {
            spent += start.elapsed();
        }
    }
    spent
}

fn backends(c: &mut Criterion) {
    // The claim of 10 timed, then the batched finalize of 100 timed, each at 1k and 100k due rows.
    group(c, "backend_claim_10", 10, true);
    group(c, "backend_finalize_100", 100, false);
}

/// One group: `batch` claimed and put back on SQLite and on PostgreSQL, at 1k and 100k due
/// rows; the claim timed when `time_claim`, else the finalize.
fn group(c: &mut Criterion, name: &str, batch: u32, time_claim: bool) {
    let rt = runtime();
    let mut group = c.benchmark_group(name);
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    group.throughput(Throughput::Elements(u64::from(batch)));
    let shapes: [(&str, u64); 2] = [("due_1k", 1_000), ("due_100k", 100_000)];
    for (label, due) in shapes {
        let sqlite = rt.block_on(benches::ScratchSqlite::new(label));
        rt.block_on(sqlite.load(due, 0));
        let db = rt.block_on(benches::scratch_db());
        rt.block_on(benches::load(&db.pool, due, 0));
        let pg = rt.block_on(benches::queue(&db.pool));
        group.bench_function(BenchmarkId::new("sqlite", label), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| claim_and_put_back(&sqlite.queue, batch, iters, time_claim))
        });
        group.bench_function(BenchmarkId::new("postgres", label), |b| {
            b.to_async(&rt)
                .iter_custom(|iters| claim_and_put_back(&pg, batch, iters, time_claim))
        });
        rt.block_on(db.drop_db());
    }
    group.finish();
}

criterion_group!(benches, backends);
criterion_main!(benches);
