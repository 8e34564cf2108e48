//! Graceful shutdown: give back what never started, let running jobs finish within the
//! deadline, then ask them to stop, then abort and give back what is left.

use tokio::time::Instant;

use super::dispatcher::Dispatcher;
use super::stats::ShutdownReport;
use crate::backend::Backend;
use crate::handler::Handler;

/// Ends everything `dispatcher` holds. Every job it claimed ends with an outcome of its own
/// (finished), or released with a fenced write; none waits for its lease to lapse unless the
/// release itself fails. Jobs aborted at the deadline are released in one batch, tried once.
pub(super) async fn shut_down<B: Backend, H: Handler>(
    dispatcher: &mut Dispatcher<B, H>,
) -> ShutdownReport {
    let shared = dispatcher.shared.clone();
    let config = &shared.config;
    let mut report = ShutdownReport::default();
    for unstarted in std::mem::take(&mut dispatcher.buffer) {
        if shared.finalizer.release(&unstarted.job, "shutdown").await {
            report.released_unstarted += 1;
        }
    }

    let deadline = Instant::now() + config.shutdown_timeout;
    report.finished_in_time += wait_until(dispatcher, deadline).await;
    if dispatcher.running.is_empty() {
        return report;
    }

    // Deadline passed: ask the handlers to stop, give them a grace period, then abort.
    for owner in dispatcher.owners.values() {
        owner.cancel.cancel();
    }
    let grace = Instant::now() + config.shutdown_grace;
    report.finished_in_time += wait_until(dispatcher, grace).await;
    dispatcher.running.abort_all();
    let mut aborted = Vec::new();
    while let Some(joined) = dispatcher.running.join_next_with_id().await {
        match dispatcher.reap(joined) {
            Some(job) => aborted.push(job),
            None => report.finished_in_time += 1,
        }
    }
    // Aborted mid-run: give the jobs back now rather than after a full lease.
    shared.finalizer.release_aborted(&aborted).await;
    report.aborted = aborted.len() as u64;
    report
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
