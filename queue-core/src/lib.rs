//! # queue-core
//!
//! The backend-agnostic heart of a durable job queue that never lets two workers finalize the
//! same job: **claim leases** with recovery folded into the claim, and **generation fencing** on
//! every write a lease holder makes.
//!
//! ```
//! use queue_core::{Backend, Handler, JobContext, JobError, MemoryBackend, NewJob, Worker, WorkerConfig};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct SendMail { to: String }
//!
//! struct Mailer;
//!
//! impl Handler for Mailer {
//!     type Payload = SendMail;
//!     async fn handle(&self, ctx: JobContext, mail: SendMail) -> Result<(), JobError> {
//!         // An external side effect: use a key of the job's own as its idempotency key.
//!         println!("job {} (claim generation {}): mail to {}", ctx.id(), ctx.generation(), mail.to);
//!         Ok(())
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> queue_core::Result<()> {
//! let queue = MemoryBackend::new(); // or queue_postgres::PgQueue in production
//! queue.enqueue(NewJob::new(&serde_json::json!({ "to": "ops@example.com" }))?).await?;
//!
//! let worker = Worker::new(queue.clone(), Mailer, WorkerConfig::default())?.start();
//! worker.wait_for(|stats| stats.completed == 1).await;
//! worker.shutdown().await?; // graceful: releases unstarted claims, waits for running jobs
//! # Ok(())
//! # }
//! ```
//!
//! ## The guarantees
//! * **At-least-once.** A job whose worker dies is claimed again once its lease (default 90 s,
//!   [`Lease::DEFAULT`]) expires; recovery is part of every claim, so it never waits for a reboot.
//! * **No conflicting outcomes.** Every write of a lease holder is a compare-and-set on
//!   `(id, status = in_flight, claim_generation, claim_token)` and reports
//!   [`FinalizeOutcome::Stale`] when another claim superseded it (even one that a store which
//!   lost writes gave the same generation: its [`ClaimToken`] differs). Finalize hooks (outbox
//!   events, domain status) run in the same transaction and only after
//!   [`FinalizeOutcome::Applied`].
//! * **What the fence cannot stop:** an external side effect (an HTTP call) made by a worker
//!   whose lease had already lapsed. Give external calls an idempotency key of the job's own, and
//!   size the lease well above the handler's worst case.
//!
//! ## Modules and features
//! * [`Backend`]: the storage contract; [`MemoryBackend`] implements it in process,
//!   `queue_postgres::PgQueue` on PostgreSQL.
//! * [`Worker`]: the runtime (bounded concurrency, wake-ups, per-job timeout, heartbeat,
//!   graceful shutdown, batched finalize).
//! * [`FinalizeHook`], [`finalize_with_hooks`]: side effects that commit with the outcome.
//! * Feature `conformance`: the suite every backend must pass (`conformance_suite!`).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
mod backend;
mod backoff;
mod error;
pub mod events;
mod handler;
mod hooks;
pub mod limits;
mod memory;
pub mod metrics;
pub mod partition;
mod retry;
pub mod schedule;
mod types;
mod worker;

#[cfg(test)]
mod fault_tests;
#[cfg(test)]
mod runtime_tests;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use admin::{
    Admin, ClaimRoom, DrainReport, JobFilter, JobPage, MAX_PAGE, MinuteCounts, PurgeRequest,
    QueueControl, QueueLimits, RETRYABLE, RateLimit, RetryTarget, ScheduleInfo, ScheduleReport,
    drain, purge, retry_with_hooks,
};
pub use backend::{Backend, BackendTx};
pub use error::{BoxError, ConfigError, Error, InvalidInput, Result};
pub use handler::{CancelReason, ErrorAction, Handler, JobContext, JobError, ResultExt};
pub use hooks::{
    FinalizeEvent, FinalizeHook, Hooks, Payload, ReopenEvent, cancel_with_hooks,
    finalize_with_hooks,
};
pub use memory::{MemoryBackend, MemoryTx};
pub use retry::RetryPolicy;
pub use types::{
    CANCEL_REQUESTED_MESSAGE, CANCELLED_BY_OPERATOR, CancelOutcome, CancelTarget, Claim,
    ClaimBatch, ClaimGeneration, ClaimRequest, ClaimToken, ClaimedJob, DEFAULT_MAX_RECLAIMS,
    Enqueued, ErrorEntry, Finalize, FinalizeOutcome, FinishedCounts, Heartbeat, JobId, JobRecord,
    JobStatus, Lease, NewJob, QueueCounts, QueueName, QueueStats, RECLAIM_CAP_MESSAGE, RunAt,
    UniqueScope,
};
pub use worker::{ShutdownReport, WaitTimedOut, Worker, WorkerConfig, WorkerHandle, WorkerStats};

/// Re-exported so adopters name the same versions the traits use.
pub use async_trait::async_trait;
pub use tokio_util::sync::CancellationToken;
