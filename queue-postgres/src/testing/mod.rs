//! Test support (feature `testing`): scratch databases, time travel and clusters of a test's own
//! for tests that talk to a real PostgreSQL, for this workspace's tests and for adopters' own.
//!
//! ```no_run
//! # async fn t() {
//! let db = queue_postgres::testing::ScratchDb::new().await; // fresh database, migrations applied
//! let queue = db.queue().await;
//! // … exercise the queue; expire leases with `age_rows` instead of sleeping …
//! queue_postgres::testing::age_rows(&db.pool, &queue_postgres::TableName::default(),
//!     std::time::Duration::from_secs(120)).await;
//! db.drop_db().await;
//! # }
//! ```

mod auto_failover;
mod cluster;

pub use auto_failover::AutoFailoverCluster;
pub use cluster::{ClusterError, StopMode, TempCluster};

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, PgPool};

use crate::{PgQueue, PgQueueConfig, TableName};

/// The server tests use: `QUEUE_TEST_PG_URL`, or `postgres://postgres@127.0.0.1:5432`.
pub fn server_url() -> String {
    std::env::var("QUEUE_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// A uniquely named database, created for one test and dropped by [`ScratchDb::drop_db`], or,
/// if the test panicked before that, when the value is dropped.
#[derive(Debug)]
pub struct ScratchDb {
    /// Its name.
    pub name: String,
    /// A pool on it (12 connections).
    pub pool: PgPool,
    admin: PgConnectOptions,
    dropped: AtomicBool,
}

impl ScratchDb {
    /// A new database with the framework's migrations applied.
    ///
    /// # Panics
    /// When PostgreSQL cannot be reached: tests that need it must fail, never skip, and the
    /// message says how to start it.
    pub async fn new() -> ScratchDb {
        let db = ScratchDb::empty().await;
        crate::migrate(&db.pool)
            .await
            .expect("apply the framework's migrations");
        db
    }

    /// A new database with nothing in it.
    pub async fn empty() -> ScratchDb {
        ScratchDb::with_prefix("queue_test").await
    }

    /// A new empty database whose name starts with `prefix`.
    pub async fn with_prefix(prefix: &str) -> ScratchDb {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let url = server_url();
        let admin = format!("{url}/postgres")
            .parse::<PgConnectOptions>()
            .expect("QUEUE_TEST_PG_URL must be a postgres:// URL")
            .disable_statement_logging();
        let mut conn = admin.connect().await.unwrap_or_else(|err| {
            panic!(
                "PostgreSQL is not reachable at {} ({err}). These tests need it and never skip: \
                 start it with `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
                 or point QUEUE_TEST_PG_URL at a server",
                crate::redact_url(&url)
            )
        });
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let name = format!(
            "{prefix}_{}_{}_{nanos}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(&mut conn)
            .await
            .expect("create the scratch database");
        let pool = PgPoolOptions::new()
            .max_connections(12)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(admin.clone().database(&name))
            .await
            .expect("connect to the scratch database");
        ScratchDb {
            name,
            pool,
            admin,
            dropped: AtomicBool::new(false),
        }
    }

    /// Options for one more connection to this database, outside the pool.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }

    /// The tokio-postgres configuration of this database (for `TpQueue` and its listener).
    #[cfg(feature = "tokio-postgres")]
    pub fn tokio_postgres_config(&self) -> tokio_postgres::Config {
        let mut config: tokio_postgres::Config = server_url()
            .parse()
            .expect("QUEUE_TEST_PG_URL must be a postgres:// URL");
        config.dbname(&self.name);
        config
    }

    /// A deadpool-postgres pool of `size` connections on this database.
    #[cfg(feature = "tokio-postgres")]
    pub fn tokio_postgres_pool(&self, size: usize) -> deadpool_postgres::Pool {
        let manager =
            deadpool_postgres::Manager::new(self.tokio_postgres_config(), tokio_postgres::NoTls);
        deadpool_postgres::Pool::builder(manager)
            .max_size(size)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .expect("a deadpool-postgres pool")
    }

    /// A queue handle on the standard table.
    pub async fn queue(&self) -> PgQueue {
        PgQueue::connect(self.pool.clone(), PgQueueConfig::default())
            .await
            .expect("the standard table passes the schema check")
    }

    /// Drops the database, ending every connection to it.
    pub async fn drop_db(&self) {
        if self.dropped.swap(true, Ordering::SeqCst) {
            return;
        }
        // A connection still checked out (a forgotten listener) must not hang the test:
        // DROP … WITH (FORCE) ends it anyway.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.pool.close()).await;
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

impl Drop for ScratchDb {
    fn drop(&mut self) {
        if self.dropped.load(Ordering::SeqCst) {
            return;
        }
        // A test that panicked never reached `drop_db`: drop the database from a thread of its
        // own (this may run inside an async runtime, which must not block on another).
        let admin = self.admin.clone();
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async move {
                if let Ok(mut conn) = admin.connect().await {
                    let _ = sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// The claim statement rendered for `table`, for tests that read its plan (`EXPLAIN`): `$1`
/// queue, `$2` batch size, `$3` lease in seconds, `$4` reclaim cap, `$5` the claimer's name,
/// `$6` the claim's token, `$7` ids never to take over.
pub fn claim_sql(table: &TableName) -> String {
    crate::sql::claim(table).expect("the claim renders for any table")
}

/// The claim of a queue with limits, rendered for `table`, for tests that read its plan:
/// parameters as [`claim_sql`]'s.
pub fn claim_limited_sql(table: &TableName) -> String {
    crate::sql::claim_limited(table).expect("the limited claim renders for any table")
}

/// The claim of a queue with queue-wide limits while they leave ample room, rendered for
/// `table`: parameters as [`claim_sql`]'s; commit it only when it returns no marker row.
pub fn claim_ahead_sql(table: &TableName) -> String {
    crate::sql::claim_ahead(table).expect("the claim ahead renders for any table")
}

/// The claim on room granted to a queue handle, rendered for `table`: parameters as
/// [`claim_sql`]'s, then `$8` the grant.
pub fn claim_granted_sql(table: &TableName) -> String {
    crate::sql::claim_granted(table).expect("the claim on a grant renders for any table")
}

/// The statements that grant room to a queue handle, rendered for `table`: the lock of the
/// queue's row (`$1` queue) and, after it in the same transaction, the grant (`$1` queue, `$2`
/// holder, `$3` batch, `$4` claims, `$5` life in milliseconds, `$6` the grants to return, an array).
pub fn grant_sql(table: &TableName) -> [String; 2] {
    let sql = crate::sql::Sql::new(table).expect("the statements render for any table");
    [sql.lock_queue.to_string(), sql.grant.to_string()]
}

/// The return of a grant by its queue handle (`return_grant.sql`), rendered for `table`: `$1`
/// queue, `$2` the grant.
pub fn return_grant_sql(table: &TableName) -> String {
    let sql = crate::sql::Sql::new(table).expect("the statements render for any table");
    sql.return_grant.to_string()
}

/// The claim of a queue whose partitions take turns, rendered for `table`, for tests that read
/// its plan: parameters as [`claim_sql`]'s.
pub fn claim_turns_sql(table: &TableName) -> String {
    crate::sql::claim_turns(table).expect("the partitions' claim renders for any table")
}

/// The claim that also writes outcomes, rendered for `table`, for tests that read its plan:
/// `$1` to `$10` the outcomes' arrays as the finalize binds them (ids, generations, statuses,
/// give-backs, run instants, delays, errors, terminal flags, kinds, tokens), then `$11` to `$17`
/// as [`claim_sql`]'s `$1` to `$7`.
pub fn finalize_claim_sql(table: &TableName) -> String {
    crate::sql::finalize_claim(table).expect("the fused claim renders for any table")
}

/// The writes by id rendered for `table`, for tests that read their plans: the finalize (`$1`
/// to `$10` as [`finalize_claim_sql`]'s), the heartbeat (`$1` id, `$2` generation, `$3` lease in
/// seconds, `$4` token), the cancel (`$1` id, `$2` queue, `$3` reason) and the heartbeats of
/// many claims (`$1` ids, `$2` generations, `$3` lease in seconds, `$4` tokens).
pub fn lease_holder_writes_sql(table: &TableName) -> [String; 4] {
    let sql = crate::sql::Sql::new(table).expect("the statements render for any table");
    [
        &sql.finalize,
        &sql.extend_lease,
        &sql.cancel,
        &sql.extend_leases,
    ]
    .map(|s| s.to_string())
}

/// The admin listing rendered for `table` and `statuses`, for tests that read its plan: `$1`
/// queue, `$2` cursor, `$3` rows.
pub fn list_jobs_sql(table: &TableName, statuses: &[queue_core::JobStatus]) -> String {
    crate::sql::Sql::new(table)
        .and_then(|sql| sql.list_jobs(statuses))
        .expect("the listing renders for any table")
}

/// The queues statement rendered for `table`, for tests that read its plan.
pub fn queues_sql(table: &TableName) -> String {
    crate::sql::for_table(crate::sql::QUEUES, table).expect("the queues statement renders")
}

/// The statistics statement rendered for `table`, for tests and benchmarks that read its plan
/// or time it: `$1` queue, `$2` window in seconds, `$3` the lease of rows without a stored one,
/// `$4` the counts' cap.
pub fn stats_sql(table: &TableName) -> String {
    crate::sql::for_table(crate::sql::STATS, table).expect("the stats render for any table")
}

/// Drops `<table>_lease_idx`, which no statement needs any more, as an operator may once every
/// process that opens the table runs a release that does not require it (docs/operations.md,
/// "Dropping `<table>_lease_idx`"): how the tests and the bench get such a table.
pub async fn drop_lease_index(pool: &PgPool, table: &TableName) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP INDEX \"{table}_lease_idx\"")))
        .execute(pool)
        .await
        .expect("drop the lease index");
}

/// Moves every stored instant of a queue table back by `by`: to its rows, the database clock
/// moved forward. The backend reads only `now()`, so this is how tests expire leases and bring
/// scheduled jobs due without sleeping.
pub async fn age_rows(pool: &PgPool, table: &TableName, by: Duration) {
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET
            next_attempt_at = next_attempt_at - make_interval(secs => $1),
            claimed_at = claimed_at - make_interval(secs => $1),
            lease_expires_at = lease_expires_at - make_interval(secs => $1),
            created_at = created_at - make_interval(secs => $1),
            updated_at = updated_at - make_interval(secs => $1),
            finished_at = finished_at - make_interval(secs => $1)",
        table.quoted()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the table's rows");
    // The rate limits' logs of recent claims, [epoch milliseconds, jobs] pairs (a room grant's
    // with its id after them), age with them.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET rate_log = COALESCE((
             SELECT jsonb_agg(jsonb_build_array((e ->> 0)::float8 - $1 * 1000) || (e - 0))
             FROM jsonb_array_elements(rate_log) AS e), '[]')",
        table.controls_quoted()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the queues' rate logs");
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}_starts\" SET
            last_at = last_at - make_interval(secs => $1),
            rate_log = COALESCE((
                SELECT jsonb_agg(jsonb_build_array((e ->> 0)::float8 - $1 * 1000, e -> 1))
                FROM jsonb_array_elements(rate_log) AS e), '[]')",
        table.as_str()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the partitions' rate logs");
    // The claims not yet folded into those logs age with them. The tally's windows are fixed
    // (numbered floor(ms / per_ms)): each moves back by the whole windows in `by`, so a window
    // cut in two by the shift is counted in the later one, which only makes the bound larger.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}_claim_starts\" SET at_ms = at_ms - $1 * 1000",
        table.as_str()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the claims not yet folded");
    // Room granted to queue handles ages with the rate log that holds it.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE \"{}_grants\" SET
            expires_at = expires_at - make_interval(secs => $1),
            granted_at = granted_at - make_interval(secs => $1)",
        table.as_str()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the grants");
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET partition_tally = partition_tally || jsonb_build_object(
             'since', (partition_tally ->> 'since')::float8 - $1 * 1000,
             'bucket', (partition_tally ->> 'bucket')::bigint
                       - floor($1 * 1000 / (partition_tally ->> 'per_ms')::float8)::bigint)
             -- Its slots move with its window (a tally without them has none to move).
             || CASE WHEN partition_tally ? 'slots_at' THEN jsonb_build_object(
                    'slots_at', (partition_tally ->> 'slots_at')::bigint
                                - floor($1 * 1000 / (partition_tally ->> 'per_ms')::float8)::bigint)
                ELSE '{{}}'::jsonb END
         WHERE partition_tally IS NOT NULL",
        table.controls_quoted()
    )))
    .bind(by.as_secs_f64())
    .execute(pool)
    .await
    .expect("age the queues' tallies");
}
