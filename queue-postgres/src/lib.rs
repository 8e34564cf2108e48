//! # queue-postgres
//!
//! The PostgreSQL backend of [`queue_core`]: a queue is a table (yours, or the standard
//! `queue_jobs`), claimed with one `FOR UPDATE SKIP LOCKED` statement that also recovers expired
//! leases, and finalized with writes fenced on `claim_generation` and `claim_token`.
//!
//! ```no_run
//! use queue_core::{Backend, Handler, JobContext, JobError, NewJob, Worker, WorkerConfig};
//! use queue_postgres::{PgQueue, PgQueueConfig, TableName};
//!
//! struct Deliver;
//! impl Handler for Deliver {
//!     type Payload = serde_json::Value;
//!     async fn handle(&self, _ctx: JobContext, hook: serde_json::Value) -> Result<(), JobError> {
//!         println!("delivering {hook}");
//!         Ok(())
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
//! // A table of your own (or `queue_postgres::migrate(&pool)` for the standard `queue_jobs`).
//! let table = TableName::new("webhook_jobs")?;
//! PgQueue::install_table(&pool, &table).await?;
//! let config = PgQueueConfig::new(table, queue_core::QueueName::new("webhooks")?);
//! let queue = PgQueue::connect(pool, config).await?; // refuses a table without the lease schema
//!
//! queue.enqueue(NewJob::new(&serde_json::json!({ "url": "https://example.com/hook" }))?).await?;
//! let worker = Worker::new(queue, Deliver, WorkerConfig::default())?.start();
//! // … on SIGTERM:
//! worker.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! ## What it does
//! * **Claim**: due pending jobs or in-flight jobs whose lease expired (a NULL `claimed_at`
//!   counts as expired), in `next_attempt_at` then priority order, two index-backed
//!   `SKIP LOCKED` picks merged, so the cost stays flat as the backlog grows. Lease arithmetic
//!   uses the database's `now()` only.
//! * **Fenced writes**: `WHERE id = … AND status = 'in_flight' AND claim_generation = … AND
//!   claim_token = …`, one outcome per job, batched with `unnest`.
//! * **Hooks** get a [`PostgresTx`]; the caller's own transaction works too
//!   ([`PostgresQueue::finalize_with`] and [`PostgresQueue::enqueue_with`] take any connection
//!   of the driver's).
//! * **Wake-ups**: `NOTIFY` in the enqueue's transaction, a `LISTEN` connection per handle,
//!   polling as the fallback.
//! * **Schema**: [`migrate`] (the standard table, its own migrations table),
//!   [`PostgresQueue::install_table`], the legacy upgrade in phases a live table survives
//!   ([`LegacyUpgrade`], run by [`PostgresQueue::upgrade_legacy_table`] or committed as
//!   migration files), and the start-up [`PostgresQueue::check_schema`].
//!
//! Every statement is a file of the crate's `sql/` folder; `docs/architecture.md` shows how a
//! job moves through them.
//!
//! ## Drivers and features
//! One queue type, [`PostgresQueue`], written once over a sealed [`Driver`]: a driver only runs
//! a statement and reads a column. Each is a feature, and either builds without the other's
//! stack:
//! * `sqlx` (default): [`PgQueue`] on a `sqlx::PgPool`. Enable a TLS feature of sqlx in your
//!   own crate if your database needs one.
//! * `tokio-postgres`: [`TokioPostgresQueue`] on a `deadpool_postgres::Pool`, with its own
//!   `LISTEN` connection, with the pool's TLS connector through
//!   [`TokioPostgresQueue::connect_with_tls`].
//! * `testing`: scratch databases and time travel for tests against a real PostgreSQL
//!   (`queue_postgres::testing`; uses sqlx).
//!
//! Statements of your own (a hook's domain write) run on either driver with
//! [`PostgresTx::execute`] and [`PostgresTx::query`]: values are [`Param`]s, rows are read as
//! [`Column`]s.
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod driver;
mod encode;
mod error;
mod ident;
mod queue;
mod redact;
mod schema;
mod sql;
mod statement;
mod upgrade;
mod wake;

#[cfg(feature = "sqlx")]
#[path = "sqlx/mod.rs"]
mod sqlx_driver;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "tokio-postgres")]
#[path = "tokio_postgres/mod.rs"]
mod tokio_postgres_driver;

pub use config::PgQueueConfig;
pub use driver::{Column, Driver, Param, ParamVisitor, Params, bounds};
pub use error::PgError;
pub use ident::TableName;
pub use queue::{PostgresQueue, PostgresTx, Row};
pub use redact::{REDACTED, redact_url};
pub use schema::{
    MIGRATIONS_TABLE, create_table_sql, table_migration_sql, table_migration_versions,
};
pub use upgrade::{
    LegacyUpgrade, MigrationFile, UpgradePhase, UpgradeProgress, UpgradeReport, UpgradeStep,
};

/// The `application_name` of `LISTEN` connections (visible in `pg_stat_activity`), both drivers.
pub const LISTENER_APPLICATION_NAME: &str = "queue-listener";

#[cfg(feature = "sqlx")]
pub use sqlx_driver::{MIGRATOR, PgQueue, PgTx, PrimaryPool, Sqlx, migrate};
#[cfg(feature = "tokio-postgres")]
#[allow(deprecated)]
pub use tokio_postgres_driver::{
    ListenTls, TokioPostgres, TokioPostgresConn, TokioPostgresQueue, TokioPostgresTx, TpQueue, TpTx,
};
