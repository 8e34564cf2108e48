//! What the PostgreSQL tests share beyond `queue_postgres::testing`: time travel, legacy rows,
//! and [`TestDriver`], which names how a test opens a pool and a queue for each real driver so
//! that every test body is written once, generic over [`queue_postgres::Driver`].

#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use queue_core::JobId;
use queue_postgres::{Driver, PgError, PgQueueConfig, PostgresQueue, TableName};
use serde_json::Value;
use sqlx::PgPool;

pub use queue_postgres::testing::ScratchDb as TestDb;

pub mod proxy;

/// Ages the rows of `table` by `by` (see `queue_postgres::testing::age_rows`).
pub async fn shift_time(pool: &PgPool, table: &str, by: Duration) {
    let table = TableName::new(table).expect("a valid table name");
    queue_postgres::testing::age_rows(pool, &table, by).await;
}

/// A row as a pre-lease release leaves it: in flight, no claim stamp, generation 0.
pub async fn insert_legacy_in_flight(
    pool: &PgPool,
    table: &str,
    queue: &str,
    payload: Value,
) -> JobId {
    let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{table}\" (queue, status, payload, attempts, next_attempt_at)
         VALUES ($1, 'in_flight', $2, 1, now() - interval '1 hour') RETURNING id"
    )))
    .bind(queue)
    .bind(payload)
    .fetch_one(pool)
    .await
    .expect("insert a legacy in-flight row");
    JobId(id)
}

/// How a test opens a driver's pool and queue: the only per-driver code of the tests.
pub trait TestDriver: Driver {
    /// A pool of `size` connections on the database at `url` (lazy: nothing connects yet).
    fn pool(url: &str, size: usize) -> Self::Pool;
    /// A queue handle on `pool`; the listener (if configured) connects to `url`.
    fn connect(
        url: &str,
        pool: Self::Pool,
        config: PgQueueConfig,
    ) -> impl Future<Output = Result<PostgresQueue<Self>, PgError>> + Send;
    /// A pool on whichever host of the multi-host `url` takes writes, kept on the primary
    /// across a failover (sqlx: [`queue_postgres::PrimaryPool`], whose follower lives as long
    /// as the guard; tokio-postgres picks the host itself at every connect).
    fn primary_pool(url: &str, size: usize) -> impl Future<Output = (Self::Pool, Guard)> + Send;
}

/// Keeps what a pool needs alive beside it.
pub type Guard = Box<dyn std::any::Any + Send + Sync>;

impl TestDriver for queue_postgres::Sqlx {
    fn pool(url: &str, size: usize) -> PgPool {
        use sqlx::ConnectOptions;
        let options = url
            .parse::<sqlx::postgres::PgConnectOptions>()
            .expect("a postgres:// URL")
            .disable_statement_logging();
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(size as u32)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options)
    }

    async fn connect(
        _url: &str,
        pool: PgPool,
        config: PgQueueConfig,
    ) -> Result<PostgresQueue<Self>, PgError> {
        PostgresQueue::<Self>::connect(pool, config).await
    }

    async fn primary_pool(url: &str, size: usize) -> (PgPool, Guard) {
        let options = sqlx::postgres::PgPoolOptions::new()
            .max_connections(size as u32)
            .acquire_timeout(Duration::from_secs(10));
        let primary = queue_postgres::PrimaryPool::connect(url, options)
            .await
            .expect("a primary among the URL's hosts");
        (primary.pool().clone(), Box::new(primary))
    }
}

#[cfg(feature = "tokio-postgres")]
impl TestDriver for queue_postgres::TokioPostgres {
    fn pool(url: &str, size: usize) -> deadpool_postgres::Pool {
        let config: tokio_postgres::Config = url.parse().expect("a postgres:// URL");
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        deadpool_postgres::Pool::builder(manager)
            .max_size(size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(Duration::from_secs(10)))
            .build()
            .expect("a deadpool-postgres pool")
    }

    async fn connect(
        url: &str,
        pool: deadpool_postgres::Pool,
        config: PgQueueConfig,
    ) -> Result<PostgresQueue<Self>, PgError> {
        let pg_config = url.parse().expect("a postgres:// URL");
        PostgresQueue::<Self>::connect(pool, config, pg_config).await
    }

    async fn primary_pool(url: &str, size: usize) -> (deadpool_postgres::Pool, Guard) {
        (Self::pool(url, size), Box::new(()))
    }
}

/// The URL of the scratch database.
pub fn url(db: &TestDb) -> String {
    format!("{}/{}", queue_postgres::testing::server_url(), db.name)
}

/// A pool of `size` connections on `db`.
pub fn pool<D: TestDriver>(db: &TestDb, size: usize) -> D::Pool {
    D::pool(&url(db), size)
}

/// A handle on `db` with a pool of 12 connections.
pub async fn connect<D: TestDriver>(
    db: &TestDb,
    config: PgQueueConfig,
) -> Result<PostgresQueue<D>, PgError> {
    D::connect(&url(db), pool::<D>(db, 12), config).await
}

/// A handle on `db`'s standard table and default queue.
pub async fn connect_default<D: TestDriver>(db: &TestDb) -> PostgresQueue<D> {
    connect(db, PgQueueConfig::default())
        .await
        .expect("the standard table passes the schema check")
}

/// A handle on `db`'s standard table and default queue whose queue row, when it writes it
/// first, has room grants off: its limited claims go ahead of the queue's row lock (or take it),
/// as every limited claim did before grants. The tests of the claim ahead and of the claims
/// under the lock use it; `grants.rs` tests the switch on.
pub async fn connect_claiming_ahead<D: TestDriver>(db: &TestDb) -> PostgresQueue<D> {
    let config = PgQueueConfig {
        room_grants_for_new_queues: false,
        ..PgQueueConfig::default()
    };
    connect(db, config)
        .await
        .expect("the standard table passes the schema check")
}

/// A handle with a pool of exactly one connection (a real separate connection per handle).
pub async fn connect_single<D: TestDriver>(db: &TestDb, config: PgQueueConfig) -> PostgresQueue<D> {
    D::connect(&url(db), pool::<D>(db, 1), config)
        .await
        .unwrap()
}

/// Expands each listed generic test `name::<D: TestDriver>()` into one test per driver, in
/// modules `sqlx_driver` and `tokio_postgres_driver`.
#[macro_export]
macro_rules! per_driver {
    ($($name:ident),+ $(,)?) => {
        mod sqlx_driver {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<queue_postgres::Sqlx>().await
                }
            )+
        }
        #[cfg(feature = "tokio-postgres")]
        mod tokio_postgres_driver {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<queue_postgres::TokioPostgres>().await
                }
            )+
        }
    };
}

/// Returns once a connection to `db` waits on a lock; fails after 10 s, saying `what`.
pub async fn wait_for_a_lock_wait(db: &TestDb, what: &str) {
    wait_for_activity(db, "wait_event_type = 'Lock'", what).await;
}

/// Returns once a connection to `db` shows in `pg_stat_activity` as `condition` (a fixed SQL
/// condition on its columns) says; fails after 10 s, saying `what`.
pub async fn wait_for_activity(db: &TestDb, condition: &'static str, what: &str) {
    let sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND {condition}"
    );
    wait_for_count(db, &sql, Duration::from_secs(10), what).await;
}

/// Returns once `sql` (a count) counts more than zero on `db`; fails after `within`, saying
/// `what`.
pub async fn wait_for_count(db: &TestDb, sql: &str, within: Duration, what: &str) {
    let deadline = std::time::Instant::now() + within;
    loop {
        let seen: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
            .fetch_one(&db.pool)
            .await
            .unwrap();
        if seen > 0 {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::task::yield_now().await;
    }
}
