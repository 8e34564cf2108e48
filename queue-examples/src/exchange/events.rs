//! The exchange's structured events, each under a stable name emitted through its constant.

use std::time::Duration;

use queue_core::JobId;

use super::TransactionStatus;

/// A send was not started: too little lease was left for the partner's timeout (warn).
pub const SEND_SKIPPED_SHORT_LEASE: &str = "exchange.send_skipped_short_lease";
/// The terminal guard refused a flip of a terminal transaction (warn).
pub const TRANSACTION_GUARD_REFUSED: &str = "exchange.transaction_guard_refused";
/// The `exchange-worker` process started (info).
pub const WORKER_STARTED: &str = "exchange.worker_started";
/// The `exchange-worker` process received SIGTERM or SIGINT and is draining (info).
pub const WORKER_DRAINING: &str = "exchange.worker_draining";
/// The `exchange-worker` process drained and stops (info).
pub const WORKER_STOPPED: &str = "exchange.worker_stopped";

pub(crate) fn send_skipped_short_lease(job: JobId, lease_left: Duration) {
    tracing::warn!(
        name: SEND_SKIPPED_SHORT_LEASE,
        job_id = job.0,
        lease_left_ms = lease_left.as_millis() as u64,
        "{SEND_SKIPPED_SHORT_LEASE}"
    );
}

/// Logs a refused terminal flip (the guard fired): the job's fenced write stays the source of
/// truth, so the finalize goes on.
pub(crate) fn guard_refused(transaction_id: i64, wanted: TransactionStatus, job_id: i64) {
    tracing::warn!(
        name: TRANSACTION_GUARD_REFUSED,
        transaction_id,
        wanted = wanted.as_str(),
        job_id,
        "{TRANSACTION_GUARD_REFUSED}: the transaction is already terminal"
    );
}
