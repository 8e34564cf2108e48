//! # queue-sqlite
//!
//! The SQLite backend of [`queue_core`]: durable and embedded, on sqlx's bundled SQLite (no
//! system package). A queue is a table of a database file; several worker processes can share
//! the file (WAL mode, a busy timeout).
//!
//! ```
//! use queue_core::{Backend, ClaimRequest, Finalize, FinalizeOutcome, Lease, NewJob};
//! use queue_sqlite::{OpenOptions, SqliteQueue, SqliteQueueConfig};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = std::env::temp_dir().join(format!("queue-sqlite-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir)?;
//! let pool = queue_sqlite::open_pool(dir.join("jobs.db"), &OpenOptions::default()).await?;
//! queue_sqlite::migrate(&pool).await?; // the standard table `queue_jobs`
//! let queue = SqliteQueue::connect(pool, SqliteQueueConfig::default()).await?;
//! queue.enqueue(NewJob::new(&"hello")?).await?;
//! let job = queue.claim(ClaimRequest::new(1, Lease::DEFAULT)).await?.jobs.remove(0);
//! assert_eq!(queue.finalize(job.claim(), &Finalize::Complete).await?, FinalizeOutcome::Applied);
//! // The same claim cannot write twice.
//! assert_eq!(queue.finalize(job.claim(), &Finalize::Complete).await?, FinalizeOutcome::Stale);
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok(()) }
//! ```
//!
//! ## What it does
//! * **Claim**: one `BEGIN IMMEDIATE` transaction takes due pending jobs and in-flight jobs whose
//!   stored lease has passed (no lease stored counts as passed), in `next_attempt_at` then
//!   priority order, each pick an ordered scan of its partial index; the generation is bumped
//!   and the lease stored with the claim. SQLite has one writer at a time, so two claims never
//!   pick the same job.
//! * **Fenced writes**: every lease-holder write is a compare-and-set on `(id, status =
//!   'in_flight', claim_generation,
//!   claim_token)`; hooks run in the same transaction, after `Applied` only.
//! * **One clock**: every instant is SQLite's `unixepoch('subsec')`, never the worker's.
//! * **The admin API** ([`queue_core::Admin`]): listing, retry, purge, pause, drain.
//! * **Bad files** are refused at [`open_pool`] with a typed [`SqliteError::Open`]: a missing
//!   directory, a read-only directory or file, a file that is not a database; a lock held past
//!   the busy timeout is [`SqliteError::Busy`].
//! * **The table** is checked at [`SqliteQueue::connect`]: every column and index, ids never
//!   reused (`AUTOINCREMENT`), types enforced (`STRICT`).
//!
//! Wake-ups reach workers of the same process at once; workers of other processes find new jobs
//! at their next poll.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod error;
mod queue;
mod schema;

/// The README's example compiles.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub use error::{OpenFailure, SqliteError};
pub use queue::{
    OpenOptions, SqliteQueue, SqliteQueueConfig, SqliteTx, list_sql, open_pool, pick_sql,
};
pub use schema::{MIGRATIONS_TABLE, MIGRATOR, TableName, create_table_sql, migrate, run_migrator};
