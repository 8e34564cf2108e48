//! The exchange's structured events, each under a stable name emitted through its constant.

use std::path::Path;
use std::time::Duration;

use queue_core::JobId;

use super::{PartnerEndpoint, PayloadError, TransactionStatus};

/// A send was not started: too little lease was left for the partner's timeout (warn).
pub const SEND_SKIPPED_SHORT_LEASE: &str = "exchange.send_skipped_short_lease";
/// The terminal guard refused a flip of a terminal transaction (warn).
pub const TRANSACTION_GUARD_REFUSED: &str = "exchange.transaction_guard_refused";
/// A send job was not sent: its payload does not name its own transaction (error).
pub const PAYLOAD_REFUSED: &str = "exchange.payload_refused";
/// A send outcome that would have ended the transaction otherwise than `failed` came with a
/// payload naming another transaction: the job's own transaction was failed instead (error).
pub const PAYLOAD_MISMATCH: &str = "exchange.payload_mismatch";
/// A partner was configured at start-up: its name, its endpoint without credentials, its send
/// timeout and its extra CA file (info).
pub const PARTNER_CONFIGURED: &str = "exchange.partner_configured";
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

pub(crate) fn payload_refused(refused: &PayloadError) {
    tracing::error!(name: PAYLOAD_REFUSED, error = %refused, "{PAYLOAD_REFUSED}");
}

/// Logs a send outcome whose payload named another transaction than the job's own: that
/// transaction was failed, whatever the outcome.
pub(crate) fn payload_mismatch(job_id: i64, own: i64) {
    tracing::error!(
        name: PAYLOAD_MISMATCH,
        job_id,
        transaction_id = own,
        "{PAYLOAD_MISMATCH}: the job's own transaction was failed"
    );
}

/// Logs a configured partner. The endpoint prints without its credentials.
pub(crate) fn partner_configured(
    name: &str,
    endpoint: &PartnerEndpoint,
    timeout: Duration,
    ca_file: Option<&Path>,
) {
    tracing::info!(
        name: PARTNER_CONFIGURED,
        partner = name,
        endpoint = %endpoint,
        credentials = endpoint.has_credentials(),
        send_timeout_ms = timeout.as_millis() as u64,
        ca_file = ca_file.map(|p| p.display().to_string()),
        "{PARTNER_CONFIGURED}"
    );
}
