//! Shared set-up for the benchmarks: a scratch PostgreSQL database with the framework's
//! migrations, and bulk loading of rows.

use std::sync::atomic::{AtomicU32, Ordering};

use queue_postgres::{PgQueue, PgQueueConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

/// The server benchmarks use; `QUEUE_BENCH_PG_URL` overrides it.
pub fn server_url() -> String {
    std::env::var("QUEUE_BENCH_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A scratch database, dropped by [`ScratchDb::drop_db`].
pub struct ScratchDb {
    /// Its name.
    pub name: String,
    /// A pool on it.
    pub pool: PgPool,
    admin: PgConnectOptions,
}

impl ScratchDb {
    /// Creates the database and applies the framework's migrations. Panics with a clear message
    /// when PostgreSQL is unreachable.
    pub async fn new(max_connections: u32) -> ScratchDb {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let url = server_url();
        let admin: PgConnectOptions = format!("{url}/postgres")
            .parse::<PgConnectOptions>()
            .expect("a postgres URL")
            .disable_statement_logging();
        let mut conn = admin.connect().await.unwrap_or_else(|err| {
            panic!("PostgreSQL is not reachable at {url} ({err}); benchmarks need it")
        });
        let name = format!(
            "queue_bench_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create the scratch database");
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .connect_with(admin.clone().database(&name))
            .await
            .expect("connect to the scratch database");
        queue_postgres::migrate(&pool).await.expect("migrate");
        ScratchDb { name, pool, admin }
    }

    /// A queue handle on the standard table, without LISTEN (benchmarks poll).
    pub async fn queue(&self) -> PgQueue {
        let config = PgQueueConfig {
            listen: false,
            ..PgQueueConfig::default()
        };
        PgQueue::connect(self.pool.clone(), config)
            .await
            .expect("schema check")
    }

    /// Inserts `n` due pending rows (bulk, server-side) and `finished` completed rows, then
    /// analyzes the table.
    pub async fn load(&self, pending: u64, finished: u64) {
        sqlx::query(
            "INSERT INTO queue_jobs (payload, next_attempt_at)
             SELECT jsonb_build_object('n', g), now() - make_interval(secs => g)
             FROM generate_series(1, $1) g",
        )
        .bind(pending as i64)
        .execute(&self.pool)
        .await
        .expect("load pending rows");
        sqlx::query(
            "INSERT INTO queue_jobs (status, payload, finished_at, next_attempt_at)
             SELECT 'completed', '{}', now(), now() FROM generate_series(1, $1)",
        )
        .bind(finished as i64)
        .execute(&self.pool)
        .await
        .expect("load finished rows");
        sqlx::raw_sql("ANALYZE queue_jobs")
            .execute(&self.pool)
            .await
            .expect("analyze");
    }

    /// Drops the database.
    pub async fn drop_db(self) {
        self.pool.close().await;
        if let Ok(mut conn) = self.admin.connect().await {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            )))
            .execute(&mut conn)
            .await;
        }
    }
}
