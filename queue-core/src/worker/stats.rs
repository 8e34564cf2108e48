//! What a worker counts, and what its shutdown reports.

use crate::types::{Finalize, FinalizeOutcome};

/// Counters of what a worker has done since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Claim statements that returned, empty or not (a test waits on this to know the worker
    /// has polled).
    pub claim_passes: u64,
    /// Jobs claimed.
    pub claimed: u64,
    /// Handler runs started.
    pub started: u64,
    /// Jobs completed (fenced write applied).
    pub completed: u64,
    /// Jobs scheduled for a retry (applied).
    pub retried: u64,
    /// Jobs failed terminally (applied).
    pub failed: u64,
    /// Jobs cancelled by their handler (applied).
    pub cancelled: u64,
    /// Claims released unstarted (applied).
    pub released: u64,
    /// Jobs their handler snoozed (applied): due again later, the run not counted.
    pub snoozed: u64,
    /// Writes refused by the fence.
    pub stale: u64,
    /// Jobs ended `dead` (applied): past the reclaim cap, or after a finalize hook kept
    /// failing.
    pub dead: u64,
    /// Finalizes that failed for good (the job waits for its lease to lapse).
    pub finalize_errors: u64,
    /// Finalizes whose commit result was lost, the job having moved on since: written or not,
    /// nobody can tell.
    pub unknown: u64,
    /// Claims that failed (the worker backs off between them).
    pub claim_failures: u64,
}

impl WorkerStats {
    /// Outcomes written or fenced: every claimed job ends up counted here exactly once (a
    /// finalize that failed for good counts in `finalize_errors`, a job ended `dead` in
    /// `dead`).
    pub fn finished(&self) -> u64 {
        self.completed
            + self.retried
            + self.failed
            + self.cancelled
            + self.released
            + self.snoozed
            + self.stale
            + self.dead
            + self.finalize_errors
            + self.unknown
    }

    pub(super) fn record(&mut self, action: &Finalize, outcome: FinalizeOutcome) {
        if outcome == FinalizeOutcome::Stale {
            self.stale += 1;
            return;
        }
        match action {
            Finalize::Complete => self.completed += 1,
            Finalize::Retry { .. } => self.retried += 1,
            Finalize::Fail { .. } => self.failed += 1,
            Finalize::Cancel { .. } => self.cancelled += 1,
            Finalize::Release => self.released += 1,
            Finalize::Snooze { .. } => self.snoozed += 1,
            Finalize::Dead { .. } => self.dead += 1,
        }
    }
}

/// What a graceful shutdown did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Claimed-but-unstarted jobs released with a fenced `release`.
    pub released_unstarted: u64,
    /// Running jobs that finished within the deadline.
    pub finished_in_time: u64,
    /// Running jobs aborted after the deadline and grace; released (fenced, in one batch
    /// without hooks) so that nothing waits for a lease to lapse.
    pub aborted: u64,
    /// The worker's counters at the end, every outcome of the shutdown included.
    pub stats: WorkerStats,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::RunAt;

    /// Each outcome a worker can write counts once among the finished: the dispatcher's
    /// wake-up after a short claim and the waits on `finished()` rely on it.
    #[test]
    fn every_outcome_counts_once_among_the_finished() {
        let at = RunAt::Now;
        let actions = [
            Finalize::Complete,
            Finalize::Retry {
                at,
                error: "e".into(),
            },
            Finalize::Fail { error: "e".into() },
            Finalize::Cancel { reason: "r".into() },
            Finalize::Release,
            Finalize::Snooze { at },
            Finalize::Dead { reason: "r".into() },
        ];
        let mut stats = WorkerStats::default();
        for (n, action) in actions.iter().enumerate() {
            stats.record(action, FinalizeOutcome::Applied);
            assert_eq!(stats.finished(), n as u64 + 1, "{action:?} applied");
        }
        stats.record(&Finalize::Complete, FinalizeOutcome::Stale);
        assert_eq!(stats.finished(), actions.len() as u64 + 1, "a stale write");
    }
}
