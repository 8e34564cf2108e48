//! Scheduled retention: finished jobs purged per status and age, in bounded batches.

use std::time::Duration;

use crate::admin::{Admin, PurgeRequest, purge};
use crate::error::{ConfigError, Result};
use crate::types::JobStatus;

use super::Schedule;

/// How long a queue keeps its finished jobs, per status, and how often a
/// [`Scheduler`](super::Scheduler) purges the older ones.
///
/// Each run deletes, for each rule, the jobs of the queue in the rule's statuses that finished
/// longer ago than its age, one bounded batch per statement (see [`PurgeRequest`]), and stops
/// between batches when the scheduler stops. Several processes may run the same retention: a
/// job is deleted once, and on PostgreSQL a batch skips the rows another one is deleting.
///
/// ```
/// use std::time::Duration;
/// use queue_core::JobStatus;
/// use queue_core::schedule::Retention;
///
/// let day = Duration::from_secs(24 * 3600);
/// let retention = Retention::every(Duration::from_secs(600))?
///     .keep(&[JobStatus::Completed, JobStatus::Cancelled], day)?
///     .keep(&[JobStatus::Failed, JobStatus::Dead], 30 * day)?
///     .batch_size(5_000);
/// assert_eq!(retention.rules().len(), 2);
/// # Ok::<(), queue_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    interval: Duration,
    rules: Vec<PurgeRequest>,
    batch_size: u32,
}

impl Retention {
    /// Retention that runs every `interval` (at least a second), with no rule yet.
    pub fn every(interval: Duration) -> std::result::Result<Self, ConfigError> {
        if interval < Duration::from_secs(1) {
            return Err(ConfigError::OutOfRange {
                name: "retention interval",
                detail: format!("{interval:?} is shorter than a second"),
            });
        }
        Ok(Retention {
            interval,
            rules: Vec::new(),
            batch_size: 1_000,
        })
    }

    /// Keeps jobs that ended in `statuses` for `age` after they finished. Refused for a live
    /// status or none (as [`PurgeRequest::new`]).
    pub fn keep(mut self, statuses: &[JobStatus], age: Duration) -> Result<Self> {
        let rule = PurgeRequest::new(statuses, age)?.batch_size(self.batch_size);
        self.rules.push(rule);
        Ok(self)
    }

    /// Rows per purge statement, for every rule: between 1 and [`PurgeRequest::MAX_BATCH`],
    /// 1 000 unless set.
    pub fn batch_size(mut self, rows: u32) -> Self {
        self.batch_size = rows.clamp(1, PurgeRequest::MAX_BATCH);
        self.rules = self
            .rules
            .into_iter()
            .map(|rule| rule.batch_size(self.batch_size))
            .collect();
        self
    }

    /// How often it runs.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Its rules, in the order they run.
    pub fn rules(&self) -> &[PurgeRequest] {
        &self.rules
    }

    /// Refuses rules that would delete a schedule's finished job before the schedule stops
    /// looking back at its period ([`super::Missed::window`]).
    pub(super) fn check_keeps(&self, schedule: &Schedule) -> std::result::Result<(), ConfigError> {
        let window = schedule.missed_policy().window();
        match self.rules.iter().find(|rule| rule.older_than() < window) {
            Some(rule) => Err(ConfigError::OutOfRange {
                name: "retention",
                detail: format!(
                    "jobs {} are kept {:?}, less than schedule {:?} looks back for missed \
                     periods ({window:?}): a period's purged job would be enqueued again",
                    rule.statuses()
                        .iter()
                        .map(|s| s.as_str())
                        .collect::<Vec<_>>()
                        .join("/"),
                    rule.older_than(),
                    schedule.name()
                ),
            }),
            None => Ok(()),
        }
    }

    /// One run: every rule in turn, each until its batches come back short or `keep_going`
    /// says stop. Returns how many jobs it deleted.
    pub async fn run<B: Admin>(
        &self,
        backend: &B,
        mut keep_going: impl FnMut() -> bool + Send,
    ) -> Result<u64> {
        let mut total = 0;
        for rule in &self.rules {
            if !keep_going() {
                break;
            }
            total += purge(backend, rule, |_| {}, &mut keep_going).await?;
        }
        Ok(total)
    }
}
