//! Shared set-up for the benchmarks: a scratch PostgreSQL database (from
//! `queue_postgres::testing`), a scratch SQLite file, and bulk loading of rows.

use std::path::PathBuf;

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

/// A SQLite database file of its own in a new temporary directory, removed when dropped.
pub struct ScratchSqlite {
    dir: PathBuf,
    /// A handle on the standard table (migrated).
    pub queue: queue_sqlite::SqliteQueue,
}

impl ScratchSqlite {
    /// A new file named after `label`, with the framework's migrations applied, opened with
    /// the default options (WAL, `synchronous = FULL`).
    pub async fn new(label: &str) -> ScratchSqlite {
        let dir = std::env::temp_dir().join(format!(
            "queue-bench-{label}-{}-{}",
            std::process::id(),
            scratch_number()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let options = queue_sqlite::OpenOptions::default();
        let pool = queue_sqlite::open_pool(dir.join("queue.db"), &options)
            .await
            .expect("open the scratch file");
        queue_sqlite::migrate(&pool).await.expect("migrate");
        let queue = queue_sqlite::SqliteQueue::connect(pool, Default::default())
            .await
            .expect("schema check");
        ScratchSqlite { dir, queue }
    }

    /// Inserts `pending` due rows and `finished` completed rows in one statement each, then
    /// analyzes.
    pub async fn load(&self, pending: u64, finished: u64) {
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO queue_jobs (payload, next_attempt_at)
             SELECT json_object('n', i), unixepoch('subsec') - i FROM n WHERE ?1 > 0",
        )
        .bind(pending as i64)
        .execute(self.queue.pool())
        .await
        .expect("load pending rows");
        sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO queue_jobs (status, finished_at)
             SELECT 'completed', unixepoch('subsec') FROM n WHERE ?1 > 0",
        )
        .bind(finished as i64)
        .execute(self.queue.pool())
        .await
        .expect("load finished rows");
        sqlx::raw_sql("ANALYZE")
            .execute(self.queue.pool())
            .await
            .expect("analyze");
    }
}

impl Drop for ScratchSqlite {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Tells apart the scratch files of one process.
fn scratch_number() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
