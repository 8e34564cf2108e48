//! Scratch databases for the PostgreSQL tests: one per test, the real migrations applied,
//! dropped at the end. Tests never skip: without a server they fail with a clear message.

#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use queue_core::JobId;
use queue_postgres::{PgQueue, PgQueueConfig};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// The server the tests use; `QUEUE_TEST_PG_URL` overrides it.
pub fn server_url() -> String {
    std::env::var("QUEUE_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

pub struct TestDb {
    pub name: String,
    pub pool: PgPool,
    admin: PgConnectOptions,
}

impl TestDb {
    /// A new, empty database with the framework's migrations applied.
    pub async fn new() -> Self {
        let db = Self::empty().await;
        queue_postgres::migrate(&db.pool)
            .await
            .expect("apply the framework's migrations");
        db
    }

    /// A new database with nothing in it (for the legacy-upgrade and schema-check tests).
    pub async fn empty() -> Self {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let url = server_url();
        let admin: PgConnectOptions = format!("{url}/postgres")
            .parse()
            .expect("QUEUE_TEST_PG_URL is a postgres URL");
        let admin = admin.disable_statement_logging();
        let mut conn = admin.connect().await.unwrap_or_else(|err| {
            panic!(
                "PostgreSQL is not reachable at {url} ({err}). These tests need it and do not skip: \
                 start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
                 or point QUEUE_TEST_PG_URL at a server"
            )
        });
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!(
            "queue_test_{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst),
            nanos
        );
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create the scratch database");
        let options = admin.clone().database(&name);
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(options)
            .await
            .expect("connect to the scratch database");
        TestDb { name, pool, admin }
    }

    /// Options for one more connection to this database (outside the pool).
    pub fn connect_options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }

    /// A queue handle on the standard table.
    pub async fn queue(&self) -> PgQueue {
        PgQueue::connect(self.pool.clone(), PgQueueConfig::default())
            .await
            .expect("the standard table passes the schema check")
    }

    /// Drops the database (closing every connection to it).
    pub async fn drop_db(&self) {
        // A connection still checked out (a forgotten listener) must not hang the test:
        // DROP … WITH (FORCE) ends it anyway.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.pool.close()).await;
        if let Ok(mut conn) = self.admin.connect().await {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            )))
            .execute(&mut conn)
            .await;
        }
    }
}

/// Moves every stored instant of `table` back by `by`: to the rows, the database clock moved
/// forward. (The backend reads only `now()`; this is how tests expire leases without sleeping.)
pub async fn shift_time(pool: &PgPool, table: &str, by: Duration) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{table}\" SET
            next_attempt_at = next_attempt_at - make_interval(secs => $1),
            claimed_at = claimed_at - make_interval(secs => $1),
            created_at = created_at - make_interval(secs => $1),
            updated_at = updated_at - make_interval(secs => $1),
            finished_at = finished_at - make_interval(secs => $1)"
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("shift stored instants");
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
