//! The receipt job: its payload and its handler.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use queue_core::{Handler, JobContext, JobError, ResultExt};
use serde::{Deserialize, Serialize};

/// The job's arguments, stored as JSON in the `payload` column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendReceipt {
    /// The order.
    pub order_id: i64,
    /// Where the receipt goes.
    pub email: String,
}

/// Every send is capped at this; the lease (90 s by default) must be well above it.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a send failed.
#[derive(Debug)]
pub enum MailError {
    /// The server refused the address: sending again cannot help.
    Rejected(String),
    /// The server asked us to wait.
    RateLimited(Duration),
}

/// A stand-in for your mail client: it records the idempotency key of every send, rejects
/// addresses at `bounce.example` and rate-limits those at `busy.example`.
#[derive(Clone, Default)]
pub struct Mailer {
    sent: Arc<Mutex<Vec<String>>>,
}

impl Mailer {
    /// Sends `body` to `to`, once per idempotency `key` on the mail server's side.
    pub async fn send(&self, key: &str, to: &str, body: &str) -> Result<(), MailError> {
        if to.ends_with("@bounce.example") {
            return Err(MailError::Rejected(format!("{to}: no such mailbox")));
        }
        if to.ends_with("@busy.example") {
            return Err(MailError::RateLimited(Duration::from_secs(60)));
        }
        println!("mail to {to} (key {key}): {body}");
        self.sent.lock().unwrap().push(key.to_owned());
        Ok(())
    }

    /// The idempotency keys sent so far.
    pub fn sent(&self) -> Vec<String> {
        self.sent.lock().unwrap().clone()
    }
}

/// Sends one receipt per job.
pub struct ReceiptHandler {
    mailer: Mailer,
}

impl ReceiptHandler {
    /// A handler sending through `mailer`.
    pub fn new(mailer: Mailer) -> Self {
        ReceiptHandler { mailer }
    }
}

impl Handler for ReceiptHandler {
    type Payload = SendReceipt;

    async fn handle(&self, ctx: JobContext, job: SendReceipt) -> Result<(), JobError> {
        // Retrying cannot fix a missing '@': the job fails now.
        if !job.email.contains('@') {
            return Err(JobError::fail("the address has no '@'"));
        }
        // The order was withdrawn meanwhile: the job is moot, not failed.
        if job.email.ends_with("@withdrawn.example") {
            return Err(JobError::cancel("order withdrawn"));
        }
        // Do not start a send that could outlive the lease: give the job back unharmed.
        if ctx.lease_remaining() < SEND_TIMEOUT {
            return Err(JobError::release("too little lease left to send"));
        }
        // A serialisation error is a bug, not a passing condition.
        let body = serde_json::to_string(&job).fail()?;
        // The idempotency key comes from the job, never from ctx.generation().
        let key = format!("receipt-{}", job.order_id);
        // A timeout may pass: `.retry()` (plain `?` on a std error does the same).
        let sent = tokio::time::timeout(SEND_TIMEOUT, self.mailer.send(&key, &job.email, &body))
            .await
            .retry()?;
        match sent {
            Ok(()) => Ok(()),
            Err(MailError::Rejected(why)) => Err(JobError::fail(why)),
            // Asked to wait is not a failure: the job runs again later, the run not counted.
            Err(MailError::RateLimited(wait)) => Err(JobError::snooze(wait)),
        }
    }
}
