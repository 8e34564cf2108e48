//! # queue-postgres
//!
//! The PostgreSQL backend of [`queue_core`]: a queue is a table (yours, or the standard
//! `queue_jobs`), claimed with one `FOR UPDATE SKIP LOCKED` statement that also recovers expired
//! leases, and finalized with writes fenced on `claim_generation`.
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
//! queue_postgres::install_table(&pool, &table).await?;
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
//! * **Claim** ([`sql::CLAIM`]): due pending jobs or in-flight jobs whose lease expired (a NULL
//!   `claimed_at` counts as expired), in `next_attempt_at` then priority order, two index-backed
//!   `SKIP LOCKED` picks merged, so the cost stays flat as the backlog grows. Lease arithmetic uses
//!   the database's `now()` only.
//! * **Fenced writes** ([`sql::FINALIZE`], [`sql::EXTEND_LEASE`]): `WHERE id = … AND status =
//!   'in_flight' AND claim_generation = …`, one outcome per job, batched with `unnest`.
//! * **Hooks** get a [`PgTx`]; the caller's own transaction works too ([`PgQueue::finalize_with`],
//!   [`PgQueue::enqueue_with`] take any `&mut PgConnection`).
//! * **Wake-ups**: `NOTIFY` in the enqueue's transaction, a `LISTEN` connection per handle, polling
//!   as the fallback.
//! * **Schema**: [`MIGRATOR`] (its own migrations table), [`install_table`], the legacy upgrade
//!   [`upgrade_legacy_table`], and the start-up [`check_schema`].
//!
//! ## Features
//! * `sqlx` (default): the sqlx driver, [`PgQueue`]. Enable a TLS feature of sqlx in your own
//!   crate if your database needs one.
//! * `testing`: scratch databases and time travel for tests against a real PostgreSQL
//!   (`queue_postgres::testing`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod batch;
mod config;
mod error;
mod ident;
pub mod sql;

pub mod schema;

#[cfg(feature = "sqlx")]
mod listener;
#[cfg(feature = "sqlx")]
mod queue;
#[cfg(feature = "testing")]
pub mod testing;
#[cfg(feature = "tokio-postgres")]
mod tp;
#[cfg(feature = "tokio-postgres")]
mod tp_listener;
#[cfg(any(feature = "sqlx", feature = "tokio-postgres"))]
mod wake;

pub use config::PgQueueConfig;
pub use error::PgError;
pub use ident::TableName;
pub use schema::{MIGRATIONS_TABLE, create_table_sql, upgrade_legacy_sql};

/// The `application_name` of `LISTEN` connections (visible in `pg_stat_activity`), both drivers.
pub const LISTENER_APPLICATION_NAME: &str = "queue-listener";

#[cfg(feature = "sqlx")]
pub use queue::{PgQueue, PgTx};
#[cfg(feature = "sqlx")]
pub use schema::{MIGRATOR, check_schema, install_table, migrate, upgrade_legacy_table};
#[cfg(feature = "tokio-postgres")]
pub use tp::{TpQueue, TpTx};
