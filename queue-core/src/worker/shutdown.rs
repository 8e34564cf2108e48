//! Graceful shutdown: give back what never started, let running jobs finish within the
//! deadline, then ask them to stop, then abort and give back what is left, all within
//! `shutdown_timeout + shutdown_grace` of the request, whatever the database does.

use std::time::Duration;

use tokio::time::Instant;

use super::dispatcher::Dispatcher;
use super::stats::ShutdownReport;
use crate::backend::Backend;
use crate::handler::{CancelReason, Handler};

/// The part of the grace kept for the last writes (the releases of aborted jobs and the last
/// batch of outcomes): half the grace, at most 2 s.
fn final_writes(grace: Duration) -> Duration {
    (grace / 2).min(Duration::from_secs(2))
}

/// Ends everything `dispatcher` holds, by `stopped + shutdown_timeout + shutdown_grace` at the
/// latest. Every job it claimed ends with an outcome of its own (finished), or is released with
/// a fenced write; one waits for its lease to lapse only if its release fails or the database
/// does not answer in time. Returns the report and the instant by which the last writes must
/// be done.
pub(super) async fn shut_down<B: Backend, H: Handler>(
    dispatcher: &mut Dispatcher<B, H>,
    stopped: Instant,
) -> (ShutdownReport, Instant) {
    let shared = dispatcher.shared.clone();
    let config = &shared.config;
    let running_until = stopped + config.shutdown_timeout;
    let end = running_until + config.shutdown_grace;
    let mut report = ShutdownReport::default();

    // A claim already sent may have taken jobs: receive them so that they are released.
    if let Some(claim) = dispatcher.claiming.take()
        && let Ok((want, sent, result)) = tokio::time::timeout_at(running_until, claim).await
    {
        dispatcher.accept(want, sent, result);
    }
    for unstarted in std::mem::take(&mut dispatcher.buffer) {
        let lease_ends = unstarted.lease_started + config.lease.duration();
        let release = shared
            .finalizer
            .release(&unstarted.job, "shutdown", lease_ends.min(end));
        if let Ok(true) = tokio::time::timeout_at(end, release).await {
            report.released_unstarted += 1;
        }
    }

    report.finished_in_time += wait_until(dispatcher, running_until).await;
    if dispatcher.running.is_empty() {
        return (report, end);
    }

    // Deadline passed: ask the handlers to stop, give them the grace, then abort.
    for owner in dispatcher.owners.values() {
        owner.cancel.fire(CancelReason::Shutdown);
    }
    let abort_at = (end - final_writes(config.shutdown_grace)).max(Instant::now());
    report.finished_in_time += wait_until(dispatcher, abort_at).await;
    dispatcher.running.abort_all();
    let mut aborted = Vec::new();
    while let Some(joined) = dispatcher.running.join_next_with_id().await {
        match dispatcher.reap(joined) {
            Some(job) => aborted.push(job),
            None => report.finished_in_time += 1,
        }
    }
    // Aborted mid-run: give the jobs back now rather than after a full lease.
    let release = shared.finalizer.release_aborted(&aborted);
    let _ = tokio::time::timeout_at(end, release).await;
    report.aborted = aborted.len() as u64;
    (report, end)
}

/// Reaps job tasks as they end until `deadline`; returns how many ended.
async fn wait_until<B: Backend, H: Handler>(
    dispatcher: &mut Dispatcher<B, H>,
    deadline: Instant,
) -> u64 {
    let mut ended = 0;
    while let Ok(Some(joined)) =
        tokio::time::timeout_at(deadline, dispatcher.running.join_next_with_id()).await
    {
        dispatcher.reap(joined);
        ended += 1;
    }
    ended
}
