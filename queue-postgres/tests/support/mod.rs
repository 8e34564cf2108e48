//! What the PostgreSQL tests share beyond `queue_postgres::testing`: time travel, legacy rows,
//! and [`Driver`], the seam that runs each PostgreSQL test once per driver.

#![allow(dead_code)]

use std::time::Duration;

use queue_core::{Backend, Claim, Finalize, FinalizeOutcome, JobId, QueueName};
use queue_postgres::{PgError, PgQueue, PgQueueConfig, TableName};
use serde_json::Value;
use sqlx::PgPool;

pub use queue_postgres::testing::ScratchDb as TestDb;

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

/// A driver of the PostgreSQL backend, as the tests need it: the driver-specific calls, so that
/// every test body is written once.
pub trait Driver: Send + Sync + 'static {
    /// The queue type.
    type Queue: Backend + std::fmt::Debug;

    /// A handle on `db` with a pool of 12 connections.
    async fn connect(db: &TestDb, config: PgQueueConfig) -> Result<Self::Queue, PgError>;
    /// A handle with a pool of exactly one connection (a real separate connection per handle).
    async fn connect_single(db: &TestDb, config: PgQueueConfig) -> Self::Queue;
    /// Creates a custom table.
    async fn install_table(db: &TestDb, table: &TableName) -> Result<(), PgError>;
    /// Upgrades a legacy table.
    async fn upgrade_legacy(
        db: &TestDb,
        table: &TableName,
        queue: &QueueName,
        drop_index: Option<&str>,
    ) -> Result<(), PgError>;
    /// The server process of a transaction's connection.
    async fn backend_pid(tx: &mut <Self::Queue as Backend>::Tx) -> i32;
    /// The retention sweep.
    async fn sweep(queue: &Self::Queue, older_than: Duration, batch: u32) -> u64;
    /// In a transaction the caller owns: the fenced writes, then a domain write
    /// (`INSERT INTO outbox VALUES (job_id)`), then commit.
    async fn finalize_with_domain_write(
        db: &TestDb,
        queue: &Self::Queue,
        items: &[(Claim, Finalize)],
        job_id: i64,
    ) -> Vec<FinalizeOutcome>;
    /// The start-up check against a server that is not there.
    async fn check_unreachable() -> PgError;

    /// The standard table's default queue.
    async fn connect_default(db: &TestDb) -> Self::Queue {
        Self::connect(db, PgQueueConfig::default())
            .await
            .expect("the standard table passes the schema check")
    }
}

/// The sqlx driver.
pub struct Sqlx;

impl Driver for Sqlx {
    type Queue = PgQueue;

    async fn connect(db: &TestDb, config: PgQueueConfig) -> Result<PgQueue, PgError> {
        PgQueue::connect(db.pool.clone(), config).await
    }

    async fn connect_single(db: &TestDb, config: PgQueueConfig) -> PgQueue {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with(db.connect_options())
            .await
            .unwrap();
        PgQueue::connect(pool, config).await.unwrap()
    }

    async fn install_table(db: &TestDb, table: &TableName) -> Result<(), PgError> {
        queue_postgres::install_table(&db.pool, table).await
    }

    async fn upgrade_legacy(
        db: &TestDb,
        table: &TableName,
        queue: &QueueName,
        drop_index: Option<&str>,
    ) -> Result<(), PgError> {
        queue_postgres::upgrade_legacy_table(&db.pool, table, queue, drop_index).await
    }

    async fn backend_pid(tx: &mut queue_postgres::PgTx) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut **tx)
            .await
            .unwrap()
    }

    async fn sweep(queue: &PgQueue, older_than: Duration, batch: u32) -> u64 {
        queue.sweep_finished(older_than, batch).await.unwrap()
    }

    async fn finalize_with_domain_write(
        db: &TestDb,
        queue: &PgQueue,
        items: &[(Claim, Finalize)],
        job_id: i64,
    ) -> Vec<FinalizeOutcome> {
        let mut conn = db.pool.acquire().await.unwrap();
        let mut tx = sqlx::Connection::begin(&mut *conn).await.unwrap();
        let outcomes = queue.finalize_with(&mut tx, items).await.unwrap();
        sqlx::query("INSERT INTO outbox VALUES ($1)")
            .bind(job_id)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcomes
    }

    async fn check_unreachable() -> PgError {
        use sqlx::ConnectOptions;
        let options = "postgres://postgres@127.0.0.1:1/none"
            .parse::<sqlx::postgres::PgConnectOptions>()
            .unwrap()
            .disable_statement_logging();
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(options);
        queue_postgres::check_schema(&pool, &TableName::default())
            .await
            .unwrap_err()
    }
}

/// The tokio-postgres + deadpool-postgres driver.
#[cfg(feature = "tokio-postgres")]
pub struct TokioPostgres;

#[cfg(feature = "tokio-postgres")]
impl Driver for TokioPostgres {
    type Queue = queue_postgres::TpQueue;

    async fn connect(db: &TestDb, config: PgQueueConfig) -> Result<Self::Queue, PgError> {
        queue_postgres::TpQueue::connect(
            db.tokio_postgres_pool(12),
            config,
            db.tokio_postgres_config(),
        )
        .await
    }

    async fn connect_single(db: &TestDb, config: PgQueueConfig) -> Self::Queue {
        queue_postgres::TpQueue::connect(
            db.tokio_postgres_pool(1),
            config,
            db.tokio_postgres_config(),
        )
        .await
        .unwrap()
    }

    async fn install_table(db: &TestDb, table: &TableName) -> Result<(), PgError> {
        queue_postgres::TpQueue::install_table(&db.tokio_postgres_pool(1), table).await
    }

    async fn upgrade_legacy(
        db: &TestDb,
        table: &TableName,
        queue: &QueueName,
        drop_index: Option<&str>,
    ) -> Result<(), PgError> {
        queue_postgres::TpQueue::upgrade_legacy_table(
            &db.tokio_postgres_pool(1),
            table,
            queue,
            drop_index,
        )
        .await
    }

    async fn backend_pid(tx: &mut queue_postgres::TpTx) -> i32 {
        tx.query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0)
    }

    async fn sweep(queue: &Self::Queue, older_than: Duration, batch: u32) -> u64 {
        queue.sweep_finished(older_than, batch).await.unwrap()
    }

    async fn finalize_with_domain_write(
        _db: &TestDb,
        queue: &Self::Queue,
        items: &[(Claim, Finalize)],
        job_id: i64,
    ) -> Vec<FinalizeOutcome> {
        let mut client = queue.pool().get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let outcomes = queue.finalize_with(&tx, items).await.unwrap();
        tx.execute("INSERT INTO outbox VALUES ($1)", &[&job_id])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        outcomes
    }

    async fn check_unreachable() -> PgError {
        let config: tokio_postgres::Config =
            "postgres://postgres@127.0.0.1:1/none".parse().unwrap();
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = deadpool_postgres::Pool::builder(manager)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .unwrap();
        queue_postgres::TpQueue::check_schema(&pool, &TableName::default())
            .await
            .unwrap_err()
    }
}

/// Expands each listed generic test `name::<D: Driver>()` into one test per driver, in modules
/// `sqlx_driver` and `tokio_postgres_driver`.
#[macro_export]
macro_rules! per_driver {
    ($($name:ident),+ $(,)?) => {
        mod sqlx_driver {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<super::support::Sqlx>().await
                }
            )+
        }
        #[cfg(feature = "tokio-postgres")]
        mod tokio_postgres_driver {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<super::support::TokioPostgres>().await
                }
            )+
        }
    };
}
