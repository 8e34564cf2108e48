//! Shared set-up for the benchmarks: a scratch PostgreSQL database (from
//! `queue_postgres::testing`) and bulk loading of rows.

use queue_postgres::testing::ScratchDb;
use queue_postgres::{PgQueue, PgQueueConfig};
use sqlx::PgPool;

/// A scratch database named `queue_bench_…` with the framework's migrations applied.
pub async fn scratch_db() -> ScratchDb {
    let db = ScratchDb::with_prefix("queue_bench").await;
    queue_postgres::migrate(&db.pool).await.expect("migrate");
    db
}

/// A queue handle on the standard table, without LISTEN (benchmarks poll).
pub async fn queue(pool: &PgPool) -> PgQueue {
    let config = PgQueueConfig {
        listen: false,
        ..PgQueueConfig::default()
    };
    PgQueue::connect(pool.clone(), config)
        .await
        .expect("schema check")
}

/// Inserts `pending` due rows and `finished` completed rows server-side, then analyzes.
pub async fn load(pool: &PgPool, pending: u64, finished: u64) {
    sqlx::query(
        "INSERT INTO queue_jobs (payload, next_attempt_at)
         SELECT jsonb_build_object('n', g), now() - make_interval(secs => g)
         FROM generate_series(1, $1) g",
    )
    .bind(pending as i64)
    .execute(pool)
    .await
    .expect("load pending rows");
    sqlx::query(
        "INSERT INTO queue_jobs (status, payload, finished_at, next_attempt_at)
         SELECT 'completed', '{}', now(), now() FROM generate_series(1, $1)",
    )
    .bind(finished as i64)
    .execute(pool)
    .await
    .expect("load finished rows");
    sqlx::raw_sql("ANALYZE queue_jobs")
        .execute(pool)
        .await
        .expect("analyze");
}
