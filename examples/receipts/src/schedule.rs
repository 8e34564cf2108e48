//! The receipts service's timetable: a daily canary receipt, and how long finished jobs stay.

use std::time::Duration;

use queue_core::schedule::{Missed, Retention, Schedule, Scheduler};
use queue_core::{Admin, Error, JobStatus, NewJob};
use serde_json::json;

const DAY: Duration = Duration::from_secs(24 * 3600);

/// A canary receipt to the operators' mailbox every day at 07:00 Berlin time: if it does not
/// arrive, the mail path is broken. A day missed by less than six hours (a deploy, an outage)
/// is still sent; each day's canary has an order id of its own (minus the day's number), so
/// the mail server's idempotency keys keep the days apart.
pub fn canary() -> Result<Schedule, Error> {
    Ok(Schedule::cron("canary-receipt", "0 7 * * *")?
        .time_zone("Europe/Berlin")?
        .missed(Missed::CatchUp {
            within: Duration::from_secs(6 * 3600),
        })
        .job(|at| {
            let day = at.timestamp().div_euclid(86_400);
            NewJob::from_value(json!({ "order_id": -day, "email": "ops@example.com" }))
        }))
}

/// Receipts sent or withdrawn are kept a week, failed and dead ones a month for the operators
/// to look into; the purge runs every ten minutes, 1 000 rows a statement.
pub fn retention() -> Result<Retention, Error> {
    Retention::every(Duration::from_secs(600))?
        .keep(&[JobStatus::Completed, JobStatus::Cancelled], 7 * DAY)?
        .keep(&[JobStatus::Failed, JobStatus::Dead], 30 * DAY)
}

/// The scheduler every process of the service runs beside its worker: no leader is needed,
/// each day's canary is enqueued once however many processes run.
pub fn scheduler<B: Admin>(queue: B) -> Result<Scheduler<B>, Error> {
    Ok(Scheduler::new(queue)
        .schedule(canary()?)?
        .retention(retention()?))
}
