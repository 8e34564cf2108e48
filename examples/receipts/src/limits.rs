//! What the mail server takes: the receipt queue's limits, for every worker of every process.

use std::time::Duration;

use queue_core::{Admin, Error, QueueControl, QueueLimits, RateLimit};

/// The mail server accepts 10 connections at once and 600 mails a minute per client: more and
/// it answers with rate-limit errors, so no worker process may exceed them, however many run.
/// Receiving servers are touchier: at most 2 mails at once to one recipient domain (a receipt's
/// partition, [`recipient_domain`](crate::orders::recipient_domain)) and 30 a minute to it
/// (more and it greylists us), the domains taking turns, so a burst of orders from one company
/// does not hold back everybody else's receipts.
pub fn mail_server() -> Result<QueueLimits, Error> {
    Ok(QueueLimits {
        max_in_flight: Some(10),
        rate: Some(RateLimit::new(600, Duration::from_secs(60))?),
        max_per_partition: Some(2),
        rate_per_partition: Some(RateLimit::new(30, Duration::from_secs(60))?),
    })
}

/// Stores the limits with the queue at start-up. They are the queue's, not the process's: the
/// last process (or operator, `queuectl queue limit`) to set them wins, and every worker obeys
/// them from its next claim.
pub async fn apply<B: Admin>(queue: &B) -> Result<QueueControl, Error> {
    queue.set_limits(mail_server()?).await
}
